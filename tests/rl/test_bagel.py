"""The job's non-diffusers path on the BAGEL-style model: built through ``NonDiffusersModelBase.from_pretrained`` from
a checkpoint directory (BAGEL's ``ema.safetensors`` names mapped), named by ``model.architecture`` (no
``model_index.json`` tells it), prompts tokenized with BAGEL's special tokens exactly as its pipeline does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.rl.adapters.bagel import BagelMoT, save_tiny_bagel
from tests.rl.common import PROMPTS, write_prompts

LORA = {"rank": 4, "alpha": 4, "target_modules": ["q_proj_moe_gen", "v_proj_moe_gen", "llm2vae"]}


@pytest.fixture(scope="module")
def bagel(tmp_path_factory) -> Path:
    return save_tiny_bagel(tmp_path_factory.mktemp("bagel") / "ckpt")


def _config(path: Path, work: Path, **sections) -> dict:
    raw = {
        "algorithm": "flowgrpo",
        "model": {"architecture": "BagelMoT", "path": str(path), "adapter": {"cfg_interval": [0.3, 1.0]}},
        "lora": LORA,
        "data": {"prompts": str(write_prompts(work)), "prompts_per_step": 2},
        "sampling": {"height": 64, "width": 48, "num_inference_steps": 4},
        "rewards": [{"callable": "tests.rl.rewards:brightness"}],
        "flowgrpo": {"group_size": 2, "window_size": 2, "kl_coef": 0.1},
        "optim": {"lr": 3e-2},
        "train": {"steps": 2},
        "log": {"dir": str(work / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw[name], **values} if isinstance(raw.get(name), dict) else values
    return raw


def test_prompt_tokens_are_bagels(bagel: Path) -> None:
    """BAGEL's layout written from its pipeline (``add_special_tokens``, ``prepare_prompts``,
    ``prepare_vae_latent``): ``[<|im_start|>] + tokenizer.encode(prompt) + [<|im_end|>]``, then
    ``[<|vision_start|>]``, one token per latent patch, ``[<|vision_end|>]``; equal to what the job feeds the model."""
    from transformers import AutoTokenizer

    from tests.rl.common import start

    tokenizer = AutoTokenizer.from_pretrained(bagel)
    run, _ = start(_config(bagel, bagel.parent))
    adapter, model = run.policy.adapter, run.policy.module
    batch = adapter.encode(PROMPTS[:3])
    c, h, w = adapter.latent_shape
    patches = (h // 2) * (w // 2)
    token = tokenizer.convert_tokens_to_ids
    for i, prompt in enumerate(PROMPTS[:3]):
        bagels = [token("<|im_start|>"), *tokenizer.encode(prompt), token("<|im_end|>")]
        bagels += [token("<|vision_start|>")] + [-1] * patches + [token("<|vision_end|>")]
        ours = batch["input_ids"][i][batch["attention_mask"][i]].tolist()
        assert model.token_layout(ours, (h, w)) == bagels
    assert (h, w) == (64 // 8, 48 // 8) and c == model.config["latent_channels"]


def test_bagel_job_logprobs_resume_and_export(bagel: Path, tmp_path: Path) -> None:
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import iteration, run_rl
    from tests.rl.common import start, trainable_state

    ckpt = tmp_path / "ckpt"
    raw = _config(bagel, tmp_path, checkpoint={"dir": str(ckpt), "interval": 1}, export={"dir": str(tmp_path / "x")})
    whole = run_rl(parse_rl_config(raw))
    assert [m["logprob_gap_max"] for m in whole.metrics] == [0.0, 0.0]
    assert whole.metrics[0]["ratio_mean"] == 1.0 and whole.metrics[1]["kl"] > 0
    # resume from step 1: step 2 again, bitwise
    again = {**raw, "checkpoint": {**raw["checkpoint"], "resume": str(ckpt / "step_000001")}, "export": {}}
    run, step = start(again)
    assert step == 1
    metrics, _ = iteration(run, 2)
    from runtime.rl.metrics import TIMING_KEYS as times

    assert {k: v for k, v in metrics.items() if k not in times} == {
        k: v for k, v in whole.metrics[1].items() if k not in times
    }
    a, b = trainable_state(whole.policy), trainable_state(run.policy)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the export is a BAGEL-style checkpoint directory: from_pretrained gives the trained (merged) model
    exported = BagelMoT.from_pretrained(tmp_path / "x").eval()
    policy = whole.policy.module.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 5), generator=g)
    x, t = torch.randn(2, 4, 8, 6, generator=g), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids, x, t), policy(ids, x, t), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(exported(ids, x, t), BagelMoT.from_pretrained(bagel)(ids, x, t))
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == sorted(
        [p.name for p in bagel.iterdir()] + ["patchgen_export.json"]
    )


@pytest.mark.parametrize(
    ("update", "words"),
    [
        ({"model": {"type": "wan"}}, "not both"),
        ({"model": {"architecture": "Nope"}}, "no adapter for 'Nope'; known: ['BagelMoT']"),
        ({"model": {"architecture": "SD3Transformer2DModel"}}, "a diffusers model"),
        ({"parallel": {"sp": 2}}, "parallel.sp: not for the non-diffusers"),
        ({"sampling": {"height": 40}}, "sampling.height: 40: expected a multiple of 16"),
        ({"model": {"adapter": {"cfg_renorm_type": "local"}}}, "model.adapter"),
        ({"lora": {"rank": 4, "target_modules": None}}, "lora.target_modules"),
    ],
)
def test_bad_bagel_configs(update, words, bagel: Path, tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    raw = _config(bagel, tmp_path)
    for section, values in update.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError) as err:
        run_rl(parse_rl_config(raw))
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("name", ["grpo_guard", "mixgrpo", "dancegrpo", "diffusionnft"])
def test_bagel_is_accepted_under_every_online_algorithm(name: str, bagel: Path, tmp_path: Path) -> None:
    """The adapter registry is keyed by architecture: BAGEL's adapter serves every algorithm (keyed by
    ``(architecture, algorithm)`` it was registered for flowgrpo only and ``algorithm: grpo_guard`` was refused)."""
    from runtime.rl.adapters.bagel import BagelMoTFlowGRPO
    from runtime.rl.config import parse_rl_config
    from runtime.rl.preflight import check_nondiffusers_model
    from tests.rl.common import for_algorithm

    raw = for_algorithm(_config(bagel, tmp_path), name)
    assert check_nondiffusers_model(parse_rl_config(raw)) is BagelMoTFlowGRPO
