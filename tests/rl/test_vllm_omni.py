import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.rl.engines.vllm_omni import (
    ENGINE_TRANSFORMERS,
    VllmOmniRollout,
    WeightSync,
    build_requests,
    parse_outputs,
    plan_weight_sync,
    vllm_omni_available,
)
from runtime.rl.engines.vllm_omni_names import EngineNames, read_wheel


def test_module_does_not_import_vllm_omni():
    assert "vllm_omni" not in sys.modules or vllm_omni_available()[0]


def test_build_requests_one_per_sample_with_own_seed():
    reqs = build_requests(
        ["a", "b"], group_size=3, seeds=range(10, 16), num_inference_steps=8, guidance_scale=4.5, height=64, width=32
    )
    assert [r.prompt for r in reqs] == ["a"] * 3 + ["b"] * 3
    assert [r.sampling["seed"] for r in reqs] == list(range(10, 16))
    assert reqs[0].sampling == {"num_inference_steps": 8, "guidance_scale": 4.5, "seed": 10, "height": 64, "width": 32}
    with pytest.raises(ValueError, match="one seed per sample"):
        build_requests(["a"], group_size=2, seeds=[1], num_inference_steps=1, guidance_scale=1, height=8, width=8)


def test_parse_outputs_documented_shape():
    outs = [SimpleNamespace(request_output=SimpleNamespace(images=[f"img{i}"])) for i in range(3)]
    assert parse_outputs(outs, 3) == ["img0", "img1", "img2"]
    with pytest.raises(ValueError, match="2 outputs for 3"):
        parse_outputs(outs[:2], 3)
    with pytest.raises(ValueError, match="no images"):
        parse_outputs([SimpleNamespace(request_output=SimpleNamespace(images=[]))], 1)


def test_rollout_without_trajectory_is_refused():
    r = VllmOmniRollout(engine=object())
    with pytest.raises(NotImplementedError, match="images only"):
        r.rollout(["a"], group_size=1, seeds=[0], num_inference_steps=2, schedule=None)


def test_real_engine_generates_images():
    ok, reason = vllm_omni_available()
    if not ok:
        pytest.skip(f"vllm-omni engine test needs an importable vllm_omni (CUDA torch build): {reason}")
    pytest.skip("no model weights are available offline to start an Omni engine with")  # pragma: no cover


# ---------------------------------------------------------------------------------------------------- weight sync
# Tested statically against the pinned vllm-omni 0.30.0 wheel's SOURCES (read from the zip, never imported: it cannot
# import with the CPU torch build). The wheel is downloaded once with `pip download --no-deps` into a cache.

WHEEL = "vllm_omni-0.30.0-py3-none-any.whl"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


@pytest.fixture(scope="module")
def wheel() -> Path:
    cache = Path.home() / ".cache" / "patchgen" / "wheels"
    path = cache / WHEEL
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", "vllm-omni==0.30.0", "--no-deps", "-d", str(cache)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if run.returncode != 0 or not path.is_file():
            pytest.skip(f"cannot download {WHEEL} (no package index?): {run.stderr.strip()[-200:]}")
    return path


def _engine(wheel: Path, model_type: str) -> EngineNames:
    return EngineNames.from_sources(read_wheel(wheel), *ENGINE_TRANSFORMERS[model_type])


def _policy(model_type: str, lora: bool):
    from runtime.config.common import LoraConfig
    from runtime.diffusion.registry import tiny_config, training_class
    from runtime.train.lora import add_lora

    cls = training_class(model_type)
    torch.manual_seed(0)
    model = cls(cls.config_class(**tiny_config(model_type)))
    if not lora:
        return model, None
    present = sorted(
        {n.rsplit(".", 1)[-1] if not n.endswith("to_out.0") else "to_out.0" for n, _ in model.named_modules()}
    )
    targets = [t for t in LORA_TARGETS if t in present]
    peft = add_lora(model, LoraConfig(rank=2, alpha=4, target_modules=targets))
    for name, p in model.named_parameters():  # a trained adapter: B no longer 0
        if ".lora_B." in name:
            p.data.normal_(generator=torch.Generator().manual_seed(1))
    return model, peft


@pytest.mark.parametrize("model_type", sorted(ENGINE_TRANSFORMERS))
def test_full_weight_sync_lands_on_engine_parameters(wheel, model_type) -> None:
    """Every parameter of ours, through the engine's own load_weights mapping (fused q/k/v, renames), names a
    parameter the engine's transformer class defines (or a part it takes from diffusers unchanged)."""
    names = _engine(wheel, model_type)
    model, _ = _policy(model_type, lora=False)
    plan = plan_weight_sync(names, dict(model.state_dict()))
    assert len(plan.full) == len(model.state_dict()) and not plan.lora
    resolved = [names.resolve(names.full_weight(n)[0]) for n, _ in plan.full]
    assert False not in resolved and resolved.count(True) > len(resolved) // 2
    if model_type != "sd3":  # q/k/v fused in the engine: our to_q lands on to_qkv's "q" shard
        q = next(n for n, _ in plan.full if n.endswith("to_q.weight"))
        target, shard = names.full_weight(q)
        assert target.endswith("to_qkv.weight") and shard == "q"


@pytest.mark.parametrize("model_type", sorted(ENGINE_TRANSFORMERS))
def test_lora_sync_binds_every_adapted_module(wheel, model_type) -> None:
    """Every LoRA-adapted module reaches the engine: as a LoRA on a module its LoRA manager binds (under the
    engine's module name), or merged into the base weight through load_weights. None is dropped."""
    from runtime.checkpoint.lora_weights import merged_state_dict

    names = _engine(wheel, model_type)
    model, peft = _policy(model_type, lora=True)
    state = dict(model.state_dict())
    plan = plan_weight_sync(names, state, peft)
    adapted = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    sent = {k.rsplit(".lora_", 1)[0] for k in plan.lora}
    assert len(sent) + len(plan.merged_modules) == len(adapted)
    assert all(names.resolve(m, module=True) is True for m in sent)
    assert plan.lora_config["target_modules"] and set(plan.lora_config["target_modules"]) <= {
        m.rsplit(".", 1)[-1] for m in sent
    }
    merged = merged_state_dict(state, peft.lora_alpha / peft.r)
    for name, tensor in plan.full:
        assert torch.equal(tensor, merged[name]) and names.resolve(names.full_weight(name)[0]) is True


def test_the_facts_the_mapping_handles(wheel) -> None:
    """Wan and Qwen-Image name the output projection ``to_out`` (ours: ``to_out.0``): sent under our name the LoRA
    would bind nothing; Flux 0.30 exposes no stacked mapping to its LoRA manager, so its q/k/v LoRA go merged."""
    wan, flux = _engine(wheel, "wan"), _engine(wheel, "flux")
    assert wan.resolve("blocks.0.attn1.to_out.0", module=True) is False
    assert wan.lora_module("blocks.0.attn1.to_out.0") == "blocks.0.attn1.to_out"
    assert wan.resolve("blocks.0.attn1.to_out", module=True) is True
    assert wan.resolve("blocks.0.attn1.to_q", module=True) is True  # a fused member the manager binds
    assert flux.resolve("transformer_blocks.0.attn.to_q", module=True) is False
    assert flux.resolve("transformer_blocks.0.attn.to_out.0", module=True) is True  # Flux keeps to_out.0
    model, peft = _policy("flux", lora=True)
    plan = plan_weight_sync(flux, dict(model.state_dict()), peft)
    assert any(m.endswith("attn.to_q") for m in plan.merged_modules)
    with pytest.raises(ValueError, match="no parameter"):
        plan_weight_sync(flux, {"transformer_blocks.0.attn.not_a_layer.weight": torch.zeros(1)})


def test_sync_hands_the_plan_to_the_engine_call(wheel) -> None:
    names = _engine(wheel, "qwenimage")
    model, peft = _policy("qwenimage", lora=True)
    got: list[WeightSync] = []
    r = VllmOmniRollout(engine=object(), apply_weights=got.append)
    plan = r.sync_weights(dict(model.state_dict()), names, peft)
    assert got == [plan] and plan.lora
    with pytest.raises(NotImplementedError, match="apply_weights"):
        VllmOmniRollout(engine=object()).sync_weights(dict(model.state_dict()), names, peft)


def test_rollout_fits_the_in_process_interface() -> None:
    """Called like runtime.rl.sampling.rollout.rollout: prompts from the batch, one request per sample seeded by its
    generator, the trajectory the engine returns as the RolloutResult."""
    from runtime.rl.sampling.scheduler import make_schedule

    class Engine:  # a stand-in engine (vllm-omni cannot run here), recording the requests
        def __init__(self):
            self.requests = []

        def generate(self, prompt, params):
            self.requests.append((prompt, params))
            return [SimpleNamespace(seed=params.seed)]

    class Adapter:
        def set_timesteps(self, n):
            return make_schedule({"shift": 3.0}, n)

    def trajectory(out):
        g = torch.Generator().manual_seed(out.seed)
        return torch.randn(3, 4, 2, 2, generator=g), torch.tensor([1, 2]), torch.randn(2, generator=g)

    engine = Engine()
    r = VllmOmniRollout(engine=engine, trajectory_from_output=trajectory)
    r._sampling_params = lambda kwargs: SimpleNamespace(**kwargs)
    gens = [torch.Generator().manual_seed(s) for s in (11, 12)]
    res = r(
        Adapter(),
        None,
        {"prompts": ["a", "b"]},
        latent_shape=(4, 2, 2),
        num_inference_steps=4,
        window_size=2,
        generators=gens,
    )
    assert [p for p, _ in engine.requests] == ["a", "b"] and [q.seed for _, q in engine.requests] == [11, 12]
    assert res.latents.shape == (2, 3, 4, 2, 2) and res.log_probs.shape == (2, 2)
    with pytest.raises(ValueError, match="2 steps, not 3"):
        r(
            Adapter(),
            None,
            {"prompts": ["a", "b"]},
            latent_shape=(4, 2, 2),
            num_inference_steps=4,
            window_size=3,
            generators=gens,
        )
