"""The Lumina2 condition model against the real ``Lumina2Pipeline``, without the spec: its tiny components around an
upstream tiny ``Lumina2Transformer2DModel``, saved with ``save_pretrained`` and loaded with the real loading code.

* prompts: ``encode_prompts`` is exactly ``pipe.encode_prompt`` (system prompt, 256 tokens, penultimate state, mask)
  and ``encode_negative_prompts`` its negative output (no system prompt there);
* the ODE path: denoising with ``sampling_schedule``, ``transformer_inputs``, ``prediction_to_latents`` and
  ``scheduler.step`` is bitwise the pipeline's ``output_type="latent"`` call from the same noise, with and without
  CFG (``combine_guidance``: the default ``cfg_normalization``), with the static-shift scheduler and with a
  dynamic-shifting one (where the pipeline's ``mu`` of the channel count matters); the Flow-GRPO rollout
  (``DiTFlowGRPO``, CFG batched) lands within 1e-5 of it (batching the two branches pads the shorter caption);
* the sign: ``process_condition``'s target is ``x0 - noise``, the LoRA script's noisy input, timestep and target,
  and a transformer that outputs exactly that target brings the pipeline itself to x0;
* the training noise levels mirror the scheduler's shift (module doc of ``runtime/diffusion/conditions/lumina2.py``);
* the example inputs run the upstream transformer; the plan file's config is complete and its inputs fit.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.lumina2 import TEXT_LENGTH, Lumina2ConditionModel
from tests.conditions.common import assert_cached_context_suffices, ode_rollout, save_tiny_pipeline

# the tiny transformer (a spec's [model.tiny] should match): head_dim 8 = sum(axes_dim_rope); 2 query heads per KV head
TINY: dict[str, Any] = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 4,
    "hidden_size": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "multiple_of": 16,
    "norm_eps": 1e-5,
    "axes_dim_rope": (4, 2, 2),
    "axes_lens": (300, 512, 512),
    "cap_feat_dim": 32,
}
PROMPT = "a small boat on a quiet lake"
NEGATIVE = "blurry"
HEIGHT, WIDTH = 32, 48  # 4x6 latents, 2x3 tokens
STEPS = 3


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_pipeline(
        Lumina2Pipeline, Lumina2ConditionModel, Lumina2Transformer2DModel, TINY, tmp_path_factory.mktemp("lumina2")
    )


@pytest.fixture(scope="module")
def cm(directory: Path) -> Lumina2ConditionModel:
    model = load_condition_model("lumina2", directory)
    assert isinstance(model, Lumina2ConditionModel)
    return model


def _pipe(directory: Path, scheduler: Any = None) -> Lumina2Pipeline:
    pipe = Lumina2Pipeline.from_pretrained(directory, **({"scheduler": scheduler} if scheduler else {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _record(model: torch.nn.Module) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def _noise(cm: Lumina2ConditionModel, seed: int = 5) -> torch.Tensor:
    shape = cm.sampling_latent_shape(HEIGHT, WIDTH)
    return torch.randn(1, *shape, generator=torch.Generator().manual_seed(seed))


def _dynamic(config: Any) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler.from_config({**config, "use_dynamic_shifting": True})


# ---- prompts ------------------------------------------------------------------------------------------------------


def test_encode_prompts_is_the_pipelines(cm: Lumina2ConditionModel, directory: Path) -> None:
    pipe = _pipe(directory)
    prompts = [PROMPT, "red"]
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    ours = cm.encode_prompts(prompts)
    assert len(ours) == 2
    for i, context in enumerate(ours):
        assert set(context) == {"encoder_hidden_states", "encoder_attention_mask"}
        assert torch.equal(context["encoder_hidden_states"], embeds[i].float())
        assert torch.equal(context["encoder_attention_mask"], mask[i])
        assert context["encoder_hidden_states"].shape[0] == TEXT_LENGTH
    # the system prompt is in (more real tokens than the prompt alone), the two prompts' lengths differ
    alone = pipe.tokenizer(PROMPT).input_ids
    lengths = [int(c["encoder_attention_mask"].sum()) for c in ours]
    assert lengths[0] > len(alone) and lengths[0] > lengths[1]
    # the negative branch: the negative prompt without the system prompt, as encode_prompt's own negative output
    _, _, neg_embeds, neg_mask = pipe.encode_prompt([PROMPT], negative_prompt=[NEGATIVE])
    negative = cm.encode_negative_prompts([NEGATIVE])[0]
    assert torch.equal(negative["encoder_hidden_states"], neg_embeds[0].float())
    assert torch.equal(negative["encoder_attention_mask"], neg_mask[0])
    assert negative["encoder_attention_mask"].sum() < cm.encode_prompts([NEGATIVE])[0]["encoder_attention_mask"].sum()
    # one prompt alone encodes as in the batch (what the rollout and the condition cache rely on)
    single = cm.encode_prompts(["red"])[0]
    assert torch.equal(single["encoder_hidden_states"], ours[1]["encoder_hidden_states"])


def test_get_condition_latents_and_inputs_are_what_the_pipeline_feeds(
    cm: Lumina2ConditionModel, directory: Path
) -> None:
    pipe = _pipe(directory)
    pixels = torch.rand(*cm.example_pixels, generator=torch.Generator().manual_seed(1)) * 2 - 1
    cond = cm.get_condition([PROMPT], [pixels])
    with torch.no_grad():
        z = pipe.vae.encode(pixels[None]).latent_dist.mode()[0]
    config = pipe.vae.config
    assert torch.equal(cond["latents"][0], (z - config.shift_factor) * config.scaling_factor)
    assert cond["latents"][0].shape == cm.sampling_latent_shape(*pixels.shape[-2:])

    calls = _record(pipe.transformer)
    pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, output_type="latent", **cm.pipeline_call)
    seen = calls[0]  # the conditional branch comes first
    assert calls[0]["hidden_states"].shape[1:] == cond["latents"][0].shape
    for key, value in cond["context"][0].items():
        assert torch.equal(seen[key][0], value), key
    inputs = cm.process_condition(cond["latents"], cond["context"], torch.Generator().manual_seed(3))
    given = {k for k, v in seen.items() if v is not None} - {"attention_kwargs", "return_dict"}
    assert set(inputs) == given
    assert set(inputs) <= set(inspect.signature(Lumina2Transformer2DModel.forward).parameters)
    assert pipe.transformer(**inputs, return_dict=False)[0].shape == inputs.target.shape
    decoded = cm.decode_latents(cond["latents"][0][None])
    assert decoded.shape == (1, *pixels.shape) and decoded.abs().max() <= 1


def test_without_encoders_process_condition_runs_from_cached_context(
    cm: Lumina2ConditionModel, directory: Path
) -> None:
    """``encoders=False`` (a trainer reading the condition cache) loads the scheduler only, with the same recipe."""
    bare = load_condition_model("lumina2", directory, encoders=False)
    x0 = [torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(0))]
    assert_cached_context_suffices(cm, bare, x0, PROMPT)


# ---- the ODE path ------------------------------------------------------------------------------------------------


def _denoise(cm: Lumina2ConditionModel, transformer: torch.nn.Module, noise: torch.Tensor, scale: float) -> Any:
    """The pipeline's loop written with the condition model's hooks (each CFG branch its own call, as the pipeline)."""
    shape = noise.shape[1:]
    facts = cm.sampling_schedule(STEPS, shape)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(cm.pipeline.scheduler.config)
    scheduler.set_timesteps(**facts)
    context = cm.encode_prompts([PROMPT])
    negative = cm.encode_negative_prompts([NEGATIVE])
    latents, timesteps = noise.clone(), []
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            sigmas = scheduler.sigmas[i].expand(latents.shape[0])
            inputs = cm.transformer_inputs(latents, context, sigmas)
            timesteps.append(inputs["timestep"])
            out = transformer(**inputs, return_dict=False)[0]
            if scale > 1:
                uncond = transformer(**cm.transformer_inputs(latents, negative, sigmas), return_dict=False)[0]
                out = cm.combine_guidance(out, uncond, scale)
            latents = scheduler.step(cm.prediction_to_latents(out, shape), t, latents, return_dict=False)[0]
    return latents, scheduler, timesteps


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_shift", "dynamic_shift"])
@pytest.mark.parametrize("scale", [1.0, 4.0], ids=["no_cfg", "cfg"])
def test_ode_path_is_the_pipelines(directory: Path, dynamic: bool, scale: float) -> None:
    cm = load_condition_model("lumina2", directory)
    pipe = _pipe(directory)
    if dynamic:
        scheduler = _dynamic(pipe.scheduler.config)
        cm.pipeline.scheduler = scheduler
        pipe = _pipe(directory, scheduler=copy.deepcopy(scheduler))
    noise = _noise(cm)
    calls = _record(pipe.transformer)
    out = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        guidance_scale=scale,
        latents=noise.clone(),
        output_type="latent",
    ).images
    ours, scheduler, timesteps = _denoise(cm, pipe.transformer, noise, scale)
    assert torch.equal(scheduler.sigmas, pipe.scheduler.sigmas)
    assert torch.equal(scheduler.timesteps, pipe.scheduler.timesteps)
    per_step = 2 if scale > 1 else 1
    for i, timestep in enumerate(timesteps):
        assert torch.equal(timestep, calls[i * per_step]["timestep"])
    assert torch.equal(ours, out)
    if dynamic:  # the pipeline's mu is of the channel count (latents.shape[1]), not of the 2x3 = 6 tokens
        from diffusers.pipelines.lumina2.pipeline_lumina2 import calculate_shift

        assert cm.sampling_schedule(STEPS, noise.shape[1:])["mu"] == calculate_shift(TINY["in_channels"])
        tokens = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)
        tokens.set_timesteps(sigmas=cm.sampling_schedule(STEPS, noise.shape[1:])["sigmas"], mu=calculate_shift(6))
        assert not torch.equal(tokens.sigmas, scheduler.sigmas)  # so this test would see a token-count mu


def test_flowgrpo_rollout_ends_where_the_pipeline_ends(cm: Lumina2ConditionModel, directory: Path) -> None:
    """The RL adapter (true CFG as one batch [negative; conditional]) at noise level 0: the pipeline's ODE path."""
    from runtime.rl.adapters.dit import DiTFlowGRPO

    pipe = _pipe(directory)
    noise = _noise(cm, seed=9)
    adapter = DiTFlowGRPO(cm, noise.shape[1:], true_cfg_scale=4.0, noise_level=0.0)
    res = ode_rollout(adapter, pipe.transformer, noise, PROMPT, NEGATIVE, STEPS)
    out = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        latents=noise.clone(),
        output_type="latent",
    ).images
    assert torch.equal(adapter.set_timesteps(STEPS).sigmas, pipe.scheduler.sigmas)
    err = ((res.final_latents.double() - out.double()).norm() / out.double().norm()).item()
    assert err < 1e-5, err


# ---- the sign of the prediction ----------------------------------------------------------------------------------


def test_target_is_x0_minus_noise_as_upstream_trains_it(cm: Lumina2ConditionModel) -> None:
    x0 = [torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    context = cm.encode_prompts([PROMPT, "red"])
    inputs = cm.process_condition(x0, context, torch.Generator().manual_seed(3))
    # the same draws, in process_condition's order
    g = torch.Generator().manual_seed(3)
    sigmas = cm.sampler.sample(2, (4 // 2) * (6 // 2), g)
    stacked = torch.stack(x0)
    noise = cm.noise_like(stacked, g)
    assert torch.equal(inputs.sigmas, sigmas)
    s = sigmas.view(-1, 1, 1, 1)
    assert torch.equal(inputs.target, stacked - noise)
    assert torch.equal(inputs["hidden_states"], (1 - s) * stacked + s * noise)
    # diffusers' train_dreambooth_lora_lumina2.py: u = the weight of x0, noisy (1 - u) noise + u x0, timestep u,
    # target x0 - noise
    u = inputs["timestep"].view(-1, 1, 1, 1)
    torch.testing.assert_close(inputs["timestep"], 1 - sigmas, rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs["hidden_states"], (1 - u) * noise + u * stacked, rtol=0, atol=1e-5)
    # the velocity the scheduler steps with is the flow velocity noise - x0
    assert torch.equal(cm.prediction_to_latents(inputs.target, stacked.shape[1:]), noise - stacked)


class _Oracle(Lumina2Transformer2DModel):
    """Outputs a fixed tensor: the training target of one clean sample and its noise."""

    answer: torch.Tensor

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        return (self.answer.expand_as(hidden_states).clone(),)


def test_a_transformer_that_outputs_the_target_brings_the_pipeline_to_x0(
    cm: Lumina2ConditionModel, directory: Path
) -> None:
    """On the straight path from noise to x0 the target ``x0 - noise`` is the same at every level: a transformer
    that outputs it exactly makes the pipeline's Euler steps (``-prediction`` into ``scheduler.step``) land on x0.
    With the sign the other way round the pipeline would end at ``2 noise - x0``."""
    pipe = _pipe(directory)
    oracle = _Oracle(**TINY)
    noise = _noise(cm, seed=11)
    x0 = torch.randn(noise.shape, generator=torch.Generator().manual_seed(12))
    inputs = cm.process_condition([x0[0]], cm.encode_prompts([PROMPT]), torch.Generator().manual_seed(1))
    sigma = inputs.sigmas.view(-1, 1, 1, 1)
    drawn = (inputs["hidden_states"] - (1 - sigma) * x0) / sigma
    oracle.answer = x0 - drawn  # what process_condition's target is for this x0 and noise
    assert torch.allclose(inputs.target, oracle.answer, atol=1e-5)
    oracle.answer = cm.latents_to_prediction(noise - x0)  # the target of the pipeline's own noise
    oracle_pipe = Lumina2Pipeline(
        transformer=oracle,
        scheduler=pipe.scheduler,
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
    )
    oracle_pipe.set_progress_bar_config(disable=True)
    out = oracle_pipe(
        prompt=PROMPT,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        latents=noise.clone(),
        output_type="latent",
    ).images
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)


# ---- noise levels, example inputs, plan -----------------------------------------------------------------------------


def test_training_noise_levels_mirror_the_scheduler_shift(cm: Lumina2ConditionModel) -> None:
    shift = cm.pipeline.scheduler.config.shift
    assert shift == 6.0 and cm.sampler.distribution == "uniform" and not cm.sampler.dynamic
    assert cm.sampler.shift == pytest.approx(1 / shift) and cm.sampler.weighting == "none"
    u = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    script = 1 - shift * u / (1 + (shift - 1) * u)  # the script's x0 weight s = shift(u); our level is 1 - s
    torch.testing.assert_close(cm.sampler._shifted(1 - u, 0), script)
    dynamic = Lumina2ConditionModel.training_sampler(_dynamic(cm.pipeline.scheduler.config).config)
    assert dynamic.shift == 1.0 and not dynamic.dynamic  # the script's training grid is unshifted then
    assert Lumina2ConditionModel.training_sampler(cm.pipeline.scheduler.config, shift=3.0).shift == 3.0


def test_example_inputs_exercise_the_split() -> None:
    """What this model's example inputs must hold for the SP suites (tests/dit/test_off_parity.py checks every
    case's are reproducible forward arguments and runs them through upstream)."""
    from runtime.diffusion.conditions.example_inputs import example_inputs

    inputs = example_inputs("lumina2", TINY, torch.Generator().manual_seed(0))
    mask = inputs["encoder_attention_mask"]
    assert mask.sum(dim=1).tolist() == [7, 4] and torch.equal(mask, mask.sort(dim=1, descending=True).values)
    h, w = inputs["hidden_states"].shape[-2:]
    tokens = (h // 2) * (w // 2)
    assert tokens % 2 and tokens % 4  # every SP run pads
    assert ((inputs["timestep"] >= 0) & (inputs["timestep"] <= 1)).all()


PLAN = Path(__file__).resolve().parents[2] / "runtime" / "plan" / "configs" / "lumina-image-2.0.yaml"


def test_plan_config_names_every_parameter_of_the_diffusers_class() -> None:
    import yaml

    config = yaml.safe_load(PLAN.read_text())["model"]["config"]
    params = set(inspect.signature(Lumina2Transformer2DModel.__init__).parameters) - {"self"}
    assert set(config) == params
    defaults = {k: p.default for k, p in inspect.signature(Lumina2Transformer2DModel.__init__).parameters.items()}
    # the 2B model is the class's defaults but for the Gemma-2-2B text width
    assert {k for k, v in config.items() if v != (list(d) if isinstance(d := defaults[k], tuple) else d)} == {
        "cap_feat_dim"
    }
    assert config["cap_feat_dim"] == config["hidden_size"] == 2304


def test_plan_inputs_fit_the_transformer() -> None:
    """``dit_inputs``' lumina2 branch (8x VAE, patch 2, a mask of ones) on a small workload and the tiny config: the
    upstream transformer takes them and returns latents of the same shape; the token count is its patchify's."""
    from diffusers.configuration_utils import FrozenDict

    from runtime.plan.config import PlanModel, Workload
    from runtime.plan.dit_inputs import dit_inputs

    inputs, tokens = dit_inputs(
        PlanModel(type="lumina2"), FrozenDict(TINY), Workload(height=64, width=96, text_tokens=9)
    )
    assert inputs["hidden_states"].shape == (1, TINY["in_channels"], 8, 12) and tokens == 4 * 6
    assert inputs["encoder_attention_mask"].shape == (1, 9) and bool(inputs["encoder_attention_mask"].all())
    torch.manual_seed(0)
    out = Lumina2Transformer2DModel(**TINY)(**inputs)[0]
    assert out.shape == inputs["hidden_states"].shape


def test_plan_file_reads_once_lumina2_is_generated() -> None:
    from runtime.models.registry import REGISTRY

    if "lumina2" not in REGISTRY:
        pytest.skip("no generated lumina2 model yet (specs/lumina2.toml): read_plan checks model.type against it")
    from runtime.plan.config import read_plan

    plan = read_plan(PLAN)
    assert plan.model.type == "lumina2" and plan.workload.text_tokens == TEXT_LENGTH
