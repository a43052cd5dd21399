"""``runtime.rl`` on the DiTs whose structures the project added after the first five (docs/dit.md, "New DiT
structures"), at Ulysses SP=2 against one process, full fine-tuning so every transformer parameter's gradient is
compared (the same bounds and reasons as ``test_job_dist``):

* Sana (linear self-attention with all-reduced key-value sums, GLUMBConv's halo rows, the row-aligned split);
* Lumina2 (each sample's joint [caption, image, padding] sequence with its key mask and one complex RoPE tensor,
  split over the ranks; the transformer predicts ``x0 - noise`` at ``1 - sigma``, the pipeline's convention);
* LTX-Video (the pipeline's packed video tokens and their RoPE tables split over the ranks, the cross-attention to
  the T5 text local; 9 tokens, so sp=2 pads);
* AuraFlow (joint blocks over [registers + text, image], then single blocks over their concatenation: the text
  replicated and first, the image split; no RoPE and no key mask, the split carried through ``attention_kwargs``);
* Wan2.2 TI2V-5B as released (a ``WanPipeline`` saved with ``expand_timesteps``: one timestep per latent token,
  sharded with the tokens). RL samples from prompts alone, so no first frame conditions the rollout.

Wan2.2 A14B (a ``WanPipeline`` with ``transformer_2`` switched at ``boundary_ratio``): one expert trains
(``dit.condition.expert``), the other runs frozen on its steps, each step's expert the one ``WanPipeline`` runs:

* the rollout's ODE path ends where ``WanPipeline`` ends from the same noise, for either expert trained; each step's
  expert is the pipeline's also for a multistep scheduler, whose integer timesteps the pipeline compares;
* two iterations train only that expert in window steps of its own, and the export is the whole pipeline (the other
  expert's files byte-identical), loaded by plain ``WanPipeline.from_pretrained`` (a LoRA of ``transformer_2`` by
  ``load_lora_weights(..., load_into_transformer_2=True)``);
* sp=2 against one process; the refusals (no expert, a window that cannot lie in the expert's steps, an algorithm
  that trains other steps) in one line with exit code 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.rl.common import SAMPLING, for_algorithm, one_iteration, references, relative_error, rl_config, start
from tests.rl.test_job_dist import FULL, GROUPS_OF_3, _compare

NOT_PROVEN_HERE = {"enabled": False, "reason": "the start-up proof is not what this test proves"}

BOUNDARY = 0.875  # Wan2.2-T2V-A14B's boundary_ratio


def _wan_pipeline(directory: Path, variant: str | None, **pipeline: object) -> Path:
    """A tiny ``WanPipeline`` of the ``wan`` spec's tiny ``variant`` config (TI2V: its T2V save, as released)."""
    import torch
    from diffusers import WanPipeline

    from runtime.diffusion.conditions.wan import WanConditionModel
    from runtime.diffusion.registry import lookup_dit, tiny_config

    config = tiny_config("wan", variant)
    torch.manual_seed(0)
    components = WanConditionModel.tiny_components(config, variant)
    components = {k: v for k, v in components.items() if k in ("tokenizer", "text_encoder", "vae", "scheduler")}
    upstream = lookup_dit("wan").upstream_class()
    components["transformer"] = upstream(**config)
    if "boundary_ratio" in pipeline:
        components["transformer_2"] = upstream(**config)
    WanPipeline(**components, **pipeline).save_pretrained(directory)
    return directory


def _raw(model: str, tiny_pipelines, tmp_path: Path) -> dict:
    if model in ("sana", "lumina2", "ltx_video", "auraflow"):
        return rl_config(model, tiny_pipelines(model), tmp_path, lora=FULL, flowgrpo=GROUPS_OF_3)
    pipeline = _wan_pipeline(tmp_path / "ti2v", "ti2v", expand_timesteps=True)
    return rl_config("wan", pipeline, tmp_path, lora=FULL, flowgrpo=GROUPS_OF_3)


@pytest.mark.dist
@pytest.mark.parametrize("model", ["sana", "wan_ti2v", "lumina2", "ltx_video", "auraflow"])
def test_sp2_equals_one_process(model: str, tiny_pipelines, tmp_path: Path) -> None:
    raw = _raw(model, tiny_pipelines, tmp_path)
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert (ranks[0]["final_latents"] == ranks[1]["final_latents"]).all()  # the SP ranks hold the same samples
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] <= 1e-6, got["metrics"]["logprob_gap_max"]
        _compare(got, ref, witness)


def test_ti2v_rollout_passes_one_timestep_per_token(tmp_path: Path) -> None:
    """The released TI2V pipeline's rollout feeds the transformer ``(b, tokens)`` timesteps, all equal (no first
    frame), as ``WanPipeline`` with ``expand_timesteps`` does."""
    import torch

    from runtime.diffusion.conditions.wan import WanConditionModel

    condition = WanConditionModel.from_pretrained(_wan_pipeline(tmp_path / "ti2v", "ti2v", expand_timesteps=True))
    shape = condition.sampling_latent_shape(SAMPLING["wan"]["height"], SAMPLING["wan"]["width"], 5)
    latents = torch.randn(2, *shape)
    context = condition.encode_prompts(["a red kite", "a green hill"])
    inputs = condition.transformer_inputs(latents, context, torch.tensor([0.5, 0.25]))
    tokens = shape[1] * (shape[2] // 2) * (shape[3] // 2)
    assert inputs["timestep"].shape == (2, tokens)
    assert torch.equal(inputs["timestep"], torch.tensor([[500.0], [250.0]]).expand(2, tokens))


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan2.2 A14B: two random Wan transformers switched at ``BOUNDARY`` (Euler, shift 5)."""
    return _wan_pipeline(tmp_path_factory.mktemp("a14b") / "a14b", None, boundary_ratio=BOUNDARY)


def _a14b_config(a14b: Path, work: Path, expert: str | None, **sections: object) -> dict:
    return rl_config("wan", a14b, work, dit={"condition": {} if expert is None else {"expert": expert}}, **sections)


def _pipeline_steps(pipe, num_steps: int) -> list[str]:
    """The expert ``pipe`` (a ``WanPipeline``) runs at each of ``num_steps`` steps, recorded by hooks while it
    samples (no CFG: one call per step)."""
    import torch

    ran: list[str] = []
    hooks = [
        getattr(pipe, name).register_forward_pre_hook(lambda *_, name=name: ran.append(name))
        for name in ("transformer", "transformer_2")
    ]
    try:
        with torch.no_grad():
            pipe(prompt="a red kite", height=32, width=32, num_frames=5, num_inference_steps=num_steps,
                 guidance_scale=1.0, output_type="latent")  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    assert len(ran) == num_steps
    return ran


def _ours(switch, num_steps: int) -> list[str]:
    from runtime.rl.experts import other_expert

    lo, hi = switch.steps(num_steps)
    return [switch.expert if lo <= i < hi else other_expert(switch.expert) for i in range(num_steps)]


@pytest.mark.parametrize("scheduler", ["euler", "unipc"])
def test_each_steps_expert_is_the_one_wan_pipeline_runs(scheduler: str, a14b: Path) -> None:
    """Against the pipeline's own choice (hooks on both transformers while ``WanPipeline`` samples): the tiny
    pipeline's Euler scheduler, and a ``UniPCMultistepScheduler`` (the released A14B's) whose integer timesteps
    differ from ``sigma * 1000``: the boundary is placed between a timestep and its truncation, where comparing
    ``sigma * 1000`` would pick the wrong expert."""
    import torch
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from runtime.rl.experts import ExpertSwitch
    from runtime.rl.sampling.scheduler import make_schedule

    pipe = WanPipeline.from_pretrained(a14b)
    pipe.set_progress_bar_config(disable=True)
    steps = 4
    if scheduler == "unipc":
        pipe.scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        t = make_schedule(pipe.scheduler, steps).timesteps[1].item()  # 900.12: the pipeline compares 900
        pipe.register_to_config(boundary_ratio=(t + int(t)) / 2 / 1000)
        assert int(t) < pipe.config.boundary_ratio * 1000 < t
    expected = _pipeline_steps(pipe, steps)
    high = 2 if scheduler == "euler" else 1  # unipc: step 1 at 900 < 900.06 runs transformer_2 (900.12 would not)
    assert expected == ["transformer"] * high + ["transformer_2"] * (steps - high)
    schedule = make_schedule(pipe.scheduler, steps)  # the rollout's
    for expert in ("transformer", "transformer_2"):
        policy, other = torch.nn.Identity(), torch.nn.Identity()
        switch = ExpertSwitch(other, expert, pipe.config.boundary_ratio, pipe.scheduler)
        assert _ours(switch, steps) == expected
        for i in range(steps):
            assert switch.module_at(policy, schedule, i) is (policy if expected[i] == expert else other)
        with pytest.raises(ValueError, match="mixes steps of both experts"):
            switch.module_at(policy, schedule, torch.tensor([high - 1, high]))
        with pytest.raises(ValueError, match="schedule"):  # a schedule that is not the pipeline's
            switch.module_at(policy, make_schedule(None, steps), 0)


@pytest.mark.parametrize(("expert", "scale_2"), [("transformer", None), ("transformer_2", None), ("transformer", 3.0)])
def test_rollout_ode_path_is_wan_pipelines(expert: str, scale_2: float | None, a14b: Path, tmp_path: Path) -> None:
    """The rollout at noise level 0 (every step the Euler ODE step) from the pipeline's starting noise ends where
    ``WanPipeline(...)(output_type="latent")`` ends, with its own two transformers, true CFG and negative prompt
    (``sampling.true_cfg_scale_2``: the pipeline's ``guidance_scale_2`` on transformer_2's steps).
    Bound 1e-5 (norm-wise): the same weights in fp32, the generated class bitwise upstream's; what differs is the
    rounding order of the Euler step and the CFG combination (tests/rl/test_dit_adapter.py's bound). One expert at
    every step ends O(1) away, so the bound tests the switch."""
    import torch
    from diffusers import WanPipeline

    from runtime.rl.sampling.rollout import rollout

    sampling = {} if scale_2 is None else {"true_cfg_scale_2": scale_2}
    raw = _a14b_config(
        a14b, tmp_path, expert, lora=FULL, train={"steps": 1, "self_check": NOT_PROVEN_HERE}, sampling=sampling
    )
    run, _ = start(raw)
    adapter, module, s = run.policy.adapter, run.policy.module.eval(), SAMPLING["wan"]
    noise = torch.randn(1, *adapter.latent_shape, generator=torch.Generator().manual_seed(3))
    lo = run.policy.trained_steps[0]

    def ours() -> torch.Tensor:
        return rollout(
            adapter, module, adapter.encode(["a red kite"], "blurry"), latent_shape=adapter.latent_shape,
            num_inference_steps=s["num_inference_steps"], window_size=1, window_start_range=(lo, lo),
            generators=[torch.Generator().manual_seed(3)], noise_level=0.0, initial_latents=noise,
        ).final_latents  # fmt: skip

    pipe = WanPipeline.from_pretrained(a14b)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        final = pipe(
            prompt="a red kite", negative_prompt="blurry", height=s["height"], width=s["width"],
            num_frames=s["frames"], num_inference_steps=s["num_inference_steps"], guidance_scale=s["true_cfg_scale"],
            guidance_scale_2=scale_2, latents=noise.clone(), output_type="latent",
        ).frames  # fmt: skip
    assert relative_error(ours(), final) <= 1e-5
    if scale_2 is not None:  # one scale on every step ends away from the pipeline's: the bound tests the scale too
        # (the tiny random experts' two predictions differ little: measured 8.2e-4, 80x the bound above)
        adapter.true_cfg_scale_2, kept = adapter.true_cfg_scale, adapter.true_cfg_scale_2
        assert relative_error(ours(), final) > 1e-4
        adapter.true_cfg_scale_2 = kept
    switch, adapter.experts = adapter.experts, None
    try:
        assert relative_error(ours(), final) > 1e-2  # the trained expert at every step
    finally:
        adapter.experts = switch


def _same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.mark.parametrize("expert", ["transformer", "transformer_2"])
def test_one_expert_trains_in_its_steps_and_exports_the_pipeline(expert: str, a14b: Path, tmp_path: Path) -> None:
    """Two iterations (full fine-tuning of ``transformer``, LoRA on ``transformer_2``): every window step is one the
    pipeline runs the expert on (its steps read from ``WanPipeline``'s scheduler), the export is the whole pipeline
    (``fuse_lora`` for the LoRA run) with the other expert's files and ``model_index.json`` byte-identical to the
    input's and the trained expert moved, loaded by plain ``WanPipeline.from_pretrained``; the LoRA file export of
    ``transformer_2`` loads with ``load_into_transformer_2=True`` and computes what the policy computes (bitwise:
    the same peft LoRA forward on the same weights)."""
    import dataclasses

    import torch
    from diffusers import WanPipeline

    from runtime.rl.experts import other_expert
    from runtime.rl.loop import iteration
    from runtime.train.dit import export
    from tests.rl.test_job import _probe

    lora = FULL if expert == "transformer" else {"rank": 4, "alpha": 4}
    out = tmp_path / "export"
    raw = _a14b_config(
        a14b,
        tmp_path,
        expert,
        lora=lora,
        optim={"lr": 3e-2},
        export={"dir": str(out), "fuse_lora": expert != "transformer"},
    )
    source = WanPipeline.from_pretrained(a14b)
    source.scheduler.set_timesteps(SAMPLING["wan"]["num_inference_steps"])
    mine = [i for i, t in enumerate(source.scheduler.timesteps) if (t >= BOUNDARY * 1000) == (expert == "transformer")]
    run, _ = start(raw)
    for step in (1, 2):
        _, res = iteration(run, step)
        assert set(res.step_indices.flatten().tolist()) <= set(mine), (res.step_indices, mine)
    run.policy.export()

    assert _same_files(a14b / other_expert(expert), out / other_expert(expert))
    assert (a14b / "model_index.json").read_bytes() == (out / "model_index.json").read_bytes()
    loaded = WanPipeline.from_pretrained(out)
    assert loaded.config.boundary_ratio == BOUNDARY
    before = getattr(source, expert).state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in getattr(loaded, expert).state_dict().items())  # it trained
    trained = run.policy.module.eval()
    if expert == "transformer":
        for name, value in trained.state_dict().items():
            assert torch.equal(loaded.transformer.state_dict()[name], value), name
        return
    config = run.config
    lora_dir = tmp_path / "lora"
    export(dataclasses.replace(config, export=dataclasses.replace(config.export, dir=str(lora_dir), fuse_lora=False)),
           run.state, run.policy.module, run.policy.ema, run.policy.peft_config)  # fmt: skip
    source.load_lora_weights(lora_dir, load_into_transformer_2=True)
    expected = _probe("wan", trained)
    assert torch.equal(_probe("wan", source.transformer_2), expected)
    # the fused weights compute it up to fp32 rounding (W + s B A rounded once against W x + s B (A x))
    assert relative_error(_probe("wan", loaded.transformer_2), expected) <= 1e-5


def test_a_checkpoint_of_one_expert_resumes_it_and_not_the_other(a14b: Path, tmp_path: Path) -> None:
    """The checkpoint identity names the expert as the trainer's does: the experts share one config, so without it a
    checkpoint of ``transformer_2`` would load into ``transformer``."""
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    ckpt = tmp_path / "ckpt"
    sections = {"train": {"steps": 1, "self_check": NOT_PROVEN_HERE}, "checkpoint": {"dir": str(ckpt), "interval": 1}}
    run_rl(parse_rl_config(_a14b_config(a14b, tmp_path, "transformer_2", **sections)))
    sections["checkpoint"]["resume"] = str(ckpt / "step_000001")
    assert start(_a14b_config(a14b, tmp_path, "transformer_2", **sections))[1] == 1
    with pytest.raises(ConfigError, match=r"checkpoint\.resume: .*expert: saved 'transformer_2'"):
        start(_a14b_config(a14b, tmp_path, "transformer", **sections))


@pytest.mark.dist
def test_a14b_sp2_equals_one_process(a14b: Path, tmp_path: Path) -> None:
    """``transformer_2`` trained, ``transformer`` frozen and run on steps 0-1 under SP with the sharded inputs: the
    TI2V case's checks and bounds."""
    raw = _a14b_config(a14b, tmp_path, "transformer_2", lora=FULL, flowgrpo=GROUPS_OF_3)
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert (ranks[0]["final_latents"] == ranks[1]["final_latents"]).all()
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] <= 1e-6, got["metrics"]["logprob_gap_max"]
        _compare(got, ref, witness)


REFUSED = [  # (expert, what else changes, the words of the one line)
    (None, {}, "dit.condition.expert: "),
    ("transformer", {"flowgrpo": {"window_size": 3}}, "lower flowgrpo.window_size to at most 2"),
    ("transformer", {"flowgrpo": {"window_size": 2, "window_range": [1, 2]}}, "window starts within 0..0"),
    ("transformer_2", {"algorithm": "diffusionnft"}, "algorithm: diffusionnft trains the forward process"),
    ("transformer_2", {"algorithm": "dancegrpo"}, "algorithm: dancegrpo trains steps anywhere"),
    ("transformer", {"sampling": {"true_cfg_scale": 1.0, "true_cfg_scale_2": 3.0}}, "sampling.true_cfg_scale_2: "),
]


@pytest.mark.parametrize(("expert", "update", "words"), REFUSED, ids=[r[2][:24] for r in REFUSED])
def test_a14b_refusals_are_one_line(expert, update, words, a14b: Path, tmp_path: Path, capsys) -> None:
    """Before the model is built, through ``python -m runtime.rl``: exit code 2 and one line."""
    import yaml

    from runtime.rl.__main__ import main

    raw = _a14b_config(a14b, tmp_path, expert, **{k: v for k, v in update.items() if k != "algorithm"})
    if "algorithm" in update:
        raw = for_algorithm(raw, update["algorithm"])
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    capsys.readouterr()
    code = main([str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert words in err and "self-check" not in out, err  # refused before the policy was built


@pytest.mark.parametrize(
    ("update", "words"),
    [
        ({"dit": {"condition": {"expert": "transformer_2"}}}, "dit.condition.expert: "),
        ({"sampling": {"true_cfg_scale_2": 3.0}}, "sampling.true_cfg_scale_2: "),
    ],
    ids=["expert", "true_cfg_scale_2"],
)
def test_expert_keys_on_one_transformer_are_one_line(update, words, tiny_pipelines, tmp_path: Path, capsys) -> None:
    """A pipeline with one transformer (Wan2.1): the keys of two experts are refused in one line, exit code 2."""
    import yaml

    from runtime.rl.__main__ import main

    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(rl_config("wan", tiny_pipelines("wan"), tmp_path, **update), sort_keys=False))
    capsys.readouterr()
    code = main([str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert words in err and "holds one transformer" in err, err
