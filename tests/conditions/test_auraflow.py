"""The AuraFlow condition model against the real ``AuraFlowPipeline``, without the spec: its tiny components around an
upstream tiny ``AuraFlowTransformer2DModel``, saved with ``save_pretrained`` and loaded with the real loading code.

* prompts: ``encode_prompts`` is exactly ``pipe.encode_prompt`` (256 tokens, the UMT5 state multiplied by the mask:
  padded tokens are zero vectors, which they are not in the encoder's raw output); a negative prompt encodes like a
  prompt, as the pipeline's negative branch does;
* what a pipeline call feeds the transformer under its default true CFG (3.5, one batch ``[negative; conditional]``):
  the contexts, the timestep ``t / 1000``, no mask and nothing else;
* the ODE path: denoising with ``sampling_schedule`` (the scheduler's own grid), ``transformer_inputs``,
  ``combine_guidance`` and ``scheduler.step`` is bitwise the pipeline's ``output_type="latent"`` call from the same
  noise, with and without CFG; the Flow-GRPO rollout (``DiTFlowGRPO``, noise level 0, CFG batched
  ``[negative; conditional]`` as the pipeline batches it) lands on the same latents bitwise as well;
* the recipe: ``process_condition``'s noisy input, timestep (sigma) and target ``noise - x0``; SimpleTuner's noise
  levels (logit-normal, shift 3); a transformer that outputs the target brings the pipeline to x0 (the sign);
* decode is the pipeline's ``vae.decode(latents / scaling_factor)``;
* the example inputs run the upstream transformer; the plan file's config is complete and its inputs fit.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.auraflow import TEXT_LENGTH, TRAINING_SHIFT, AuraFlowConditionModel
from tests.conditions.common import assert_cached_context_suffices, ode_rollout, save_tiny_pipeline

# the tiny transformer (specs/auraflow.toml's [model.tiny]): 4 heads of 8; one joint and two single blocks
TINY: dict[str, Any] = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_mmdit_layers": 1,
    "num_single_dit_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "joint_attention_dim": 24,
    "caption_projection_dim": 32,
    "pos_embed_max_size": 256,
}
PROMPT = "a small boat on a quiet lake"
NEGATIVE = "blurry"
HEIGHT, WIDTH = 32, 48  # 4x6 latents, 2x3 tokens
STEPS = 3
GUIDANCE = 3.5  # AuraFlowPipeline.__call__'s default guidance_scale


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_pipeline(
        AuraFlowPipeline, AuraFlowConditionModel, AuraFlowTransformer2DModel, TINY, tmp_path_factory.mktemp("auraflow")
    )


@pytest.fixture(scope="module")
def cm(directory: Path) -> AuraFlowConditionModel:
    model = load_condition_model("auraflow", directory)
    assert isinstance(model, AuraFlowConditionModel)
    return model


def _pipe(directory: Path) -> AuraFlowPipeline:
    pipe = AuraFlowPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _record(model: torch.nn.Module) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    names = list(inspect.signature(model.forward).parameters)  # the pipeline passes the latents positionally
    model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append({**dict(zip(names, args, strict=False)), **kwargs}), with_kwargs=True
    )
    return calls


def _noise(cm: AuraFlowConditionModel, seed: int = 5) -> torch.Tensor:
    shape = cm.sampling_latent_shape(HEIGHT, WIDTH)
    return torch.randn(1, *shape, generator=torch.Generator().manual_seed(seed))


def _call(pipe: AuraFlowPipeline, noise: torch.Tensor, scale: float, steps: int = STEPS) -> torch.Tensor:
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=steps,
        guidance_scale=scale,
        latents=noise.clone(),
        output_type="latent",
    ).images


# ---- prompts ------------------------------------------------------------------------------------------------------


def test_encode_prompts_is_the_pipelines(cm: AuraFlowConditionModel, directory: Path) -> None:
    pipe = _pipe(directory)
    prompts = [PROMPT, "red"]
    embeds, _, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    ours = cm.encode_prompts(prompts)
    assert len(ours) == 2
    for i, context in enumerate(ours):
        assert set(context) == {"encoder_hidden_states"}  # the transformer takes no mask
        assert torch.equal(context["encoder_hidden_states"], embeds[i].float())
        assert context["encoder_hidden_states"].shape == (TEXT_LENGTH, TINY["joint_attention_dim"])
    # the state is multiplied by the mask: the padded tokens are zero here, not in the encoder's own output
    tokens = pipe.tokenizer(
        prompts, padding="max_length", max_length=TEXT_LENGTH, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        raw = pipe.text_encoder(**tokens)[0]
    for i, context in enumerate(ours):
        real = int(tokens.attention_mask[i].sum())
        assert 0 < real < TEXT_LENGTH
        assert torch.equal(context["encoder_hidden_states"][:real], raw[i, :real])
        assert not context["encoder_hidden_states"][real:].any() and raw[i, real:].abs().sum() > 0
    # one prompt alone encodes as in the batch (what the rollout and the condition cache rely on)
    assert torch.equal(cm.encode_prompts(["red"])[0]["encoder_hidden_states"], ours[1]["encoder_hidden_states"])
    # the negative branch: the negative prompt like any prompt (the same 256-token padding)
    _, _, negative, _ = pipe.encode_prompt([PROMPT], negative_prompt=[NEGATIVE])
    assert torch.equal(cm.encode_negative_prompts([NEGATIVE])[0]["encoder_hidden_states"], negative[0].float())


def test_the_pipelines_call_feeds_the_condition_models_inputs(cm: AuraFlowConditionModel, directory: Path) -> None:
    """Under the default true CFG the pipeline runs one batch ``[negative; conditional]``: each half is the condition
    model's context, the timestep is ``t / 1000`` (equal to ``transformer_inputs``' bitwise), and the call passes
    exactly the keys ``process_condition`` returns (no mask)."""
    pipe = _pipe(directory)
    calls = _record(pipe.transformer)
    noise = _noise(cm)
    _call(pipe, noise, GUIDANCE, steps=2)
    assert len(calls) == 2  # one batched call per step
    seen = calls[0]
    context, negative = cm.encode_prompts([PROMPT])[0], cm.encode_negative_prompts([NEGATIVE])[0]
    assert seen["hidden_states"].shape == (2, *noise.shape[1:])
    assert torch.equal(seen["encoder_hidden_states"][0], negative["encoder_hidden_states"])
    assert torch.equal(seen["encoder_hidden_states"][1], context["encoder_hidden_states"])
    for i, call in enumerate(calls):
        sigmas = pipe.scheduler.sigmas[i].expand(2)
        assert torch.equal(call["timestep"], cm.transformer_inputs(noise, [context] * 2, sigmas)["timestep"])
    inputs = cm.process_condition([noise[0]], [context], torch.Generator().manual_seed(3))
    given = {k for k, v in seen.items() if v is not None} - {"attention_kwargs", "return_dict"}
    assert set(inputs) == given == {"hidden_states", "timestep", "encoder_hidden_states"}
    assert set(inputs) <= set(inspect.signature(AuraFlowTransformer2DModel.forward).parameters)


def test_latents_and_decode_are_the_pipelines(cm: AuraFlowConditionModel, directory: Path) -> None:
    pipe = _pipe(directory)
    pixels = torch.rand(*cm.example_pixels, generator=torch.Generator().manual_seed(1)) * 2 - 1
    cond = cm.get_condition([PROMPT], [pixels])
    with torch.no_grad():
        z = pipe.vae.encode(pixels[None]).latent_dist.mode()[0]
    assert pipe.vae.config.scaling_factor == 0.13025 and pipe.vae.config.shift_factor is None
    assert torch.equal(cond["latents"][0], z * pipe.vae.config.scaling_factor)
    assert cond["latents"][0].shape == cm.sampling_latent_shape(*pixels.shape[-2:])
    latents = cond["latents"][0][None]
    with torch.no_grad():  # the pipeline's decode: latents / scaling_factor, no shift
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    assert torch.equal(cm.decode_latents(latents), image.clamp(-1, 1))


def test_without_encoders_process_condition_runs_from_cached_context(
    cm: AuraFlowConditionModel, directory: Path
) -> None:
    """``encoders=False`` (a trainer reading the condition cache) loads the scheduler only, with the same recipe."""
    bare = load_condition_model("auraflow", directory, encoders=False)
    x0 = [torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(0))]
    assert_cached_context_suffices(cm, bare, x0, PROMPT)


# ---- the ODE path ------------------------------------------------------------------------------------------------


def _denoise(cm: AuraFlowConditionModel, transformer: torch.nn.Module, noise: torch.Tensor, scale: float) -> Any:
    """The pipeline's loop written with the condition model's hooks; under CFG one batch [negative; conditional],
    as the pipeline runs it."""
    shape = noise.shape[1:]
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(cm.pipeline.scheduler.config)
    scheduler.set_timesteps(STEPS, **cm.sampling_schedule(STEPS, shape))
    context = cm.encode_prompts([PROMPT])
    negative = cm.encode_negative_prompts([NEGATIVE])
    latents = noise.clone()
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            if scale > 1:
                sigmas = scheduler.sigmas[i].expand(2 * latents.shape[0])
                inputs = cm.transformer_inputs(torch.cat([latents, latents]), negative + context, sigmas)
                uncond, cond = transformer(**inputs, return_dict=False)[0].chunk(2)
                out = cm.combine_guidance(cond, uncond, scale)
            else:
                sigmas = scheduler.sigmas[i].expand(latents.shape[0])
                out = transformer(**cm.transformer_inputs(latents, context, sigmas), return_dict=False)[0]
            latents = scheduler.step(cm.prediction_to_latents(out, shape), t, latents, return_dict=False)[0]
    return latents, scheduler


@pytest.mark.parametrize("scale", [1.0, GUIDANCE], ids=["no_cfg", "cfg"])
def test_ode_path_is_the_pipelines(cm: AuraFlowConditionModel, directory: Path, scale: float) -> None:
    pipe = _pipe(directory)
    noise = _noise(cm)
    out = _call(pipe, noise, scale)
    ours, scheduler = _denoise(cm, pipe.transformer, noise, scale)
    assert cm.sampling_schedule(STEPS, noise.shape[1:]) == {}  # the scheduler's own grid, as the pipeline's call
    assert torch.equal(scheduler.sigmas, pipe.scheduler.sigmas)
    assert torch.equal(scheduler.timesteps, pipe.scheduler.timesteps)
    unshifted = FlowMatchEulerDiscreteScheduler()
    unshifted.set_timesteps(STEPS)
    assert not torch.equal(unshifted.sigmas, scheduler.sigmas)  # the tiny scheduler's shift (1.73) is in the grid
    assert torch.equal(ours, out)


def test_flowgrpo_rollout_ends_where_the_pipeline_ends(cm: AuraFlowConditionModel, directory: Path) -> None:
    """The RL adapter at noise level 0 (true CFG as one batch [negative; conditional], the pipeline's own layout):
    the pipeline's ODE path, bitwise."""
    from runtime.rl.adapters.dit import DiTFlowGRPO

    pipe = _pipe(directory)
    noise = _noise(cm, seed=9)
    adapter = DiTFlowGRPO(cm, noise.shape[1:], true_cfg_scale=GUIDANCE, noise_level=0.0)
    res = ode_rollout(adapter, pipe.transformer, noise, PROMPT, NEGATIVE, STEPS)
    out = _call(pipe, noise, GUIDANCE)
    assert torch.equal(adapter.set_timesteps(STEPS).sigmas, pipe.scheduler.sigmas)
    assert torch.equal(res.final_latents, out)


# ---- the training recipe -------------------------------------------------------------------------------------------


def test_process_condition_is_the_flow_matching_recipe(cm: AuraFlowConditionModel) -> None:
    x0 = [torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    context = cm.encode_prompts([PROMPT, "red"])
    inputs = cm.process_condition(x0, context, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the same draws, in process_condition's order
    sigmas = cm.sampler.sample(2, (4 // 2) * (6 // 2), g)
    stacked = torch.stack(x0)
    noise = cm.noise_like(stacked, g)
    s = sigmas.view(-1, 1, 1, 1)
    assert torch.equal(inputs.sigmas, sigmas)
    assert torch.equal(inputs.target, noise - stacked)
    assert torch.equal(inputs["hidden_states"], (1 - s) * stacked + s * noise)
    # SimpleTuner feeds the transformer sigma * 1000 / 1000: sigma up to float32 rounding
    torch.testing.assert_close(inputs["timestep"], sigmas, rtol=0, atol=1e-7)
    assert torch.equal(inputs["timestep"], (sigmas * 1000) / 1000)


def test_training_noise_levels_are_simpletuners(cm: AuraFlowConditionModel) -> None:
    sampler = cm.sampler
    assert cm.pipeline.scheduler.config.shift == 1.73  # the sampling shift, which the training recipe does not use
    assert sampler.distribution == "logit_normal" and (sampler.logit_mean, sampler.logit_std) == (0.0, 1.0)
    assert sampler.shift == TRAINING_SHIFT == 3.0 and not sampler.dynamic and sampler.weighting == "none"
    g = torch.Generator().manual_seed(0)
    u = torch.sigmoid(torch.randn(5, generator=g))  # SimpleTuner: sigmoid(flow_sigmoid_scale * randn), scale 1
    expected = (3.0 * u.double() / (1 + 2.0 * u.double())).float()  # apply_flow_schedule_shift, shift 3
    torch.testing.assert_close(sampler.sample(5, 0, torch.Generator().manual_seed(0)), expected, rtol=1e-6, atol=0)
    assert AuraFlowConditionModel.training_sampler(cm.pipeline.scheduler.config, shift=1.0).shift == 1.0


class _Oracle(AuraFlowTransformer2DModel):
    """Outputs a fixed tensor: the training target of one clean sample and its noise."""

    answer: torch.Tensor

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        return (self.answer.expand_as(hidden_states).clone(),)


def test_a_transformer_that_outputs_the_target_brings_the_pipeline_to_x0(
    cm: AuraFlowConditionModel, directory: Path
) -> None:
    """On the straight path from noise to x0 the target ``noise - x0`` is the same at every level: a transformer
    that outputs it makes the pipeline's Euler steps land on x0 (with the other sign it would end at
    ``2 noise - x0``)."""
    pipe = _pipe(directory)
    oracle = _Oracle(**TINY)
    noise = _noise(cm, seed=11)
    x0 = torch.randn(noise.shape, generator=torch.Generator().manual_seed(12))
    oracle.answer = cm.latents_to_prediction(noise - x0)
    oracle_pipe = AuraFlowPipeline(
        transformer=oracle,
        scheduler=pipe.scheduler,
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
    )
    oracle_pipe.set_progress_bar_config(disable=True)
    torch.testing.assert_close(_call(oracle_pipe, noise, 1.0), x0, rtol=0, atol=1e-5)


# ---- example inputs, plan ------------------------------------------------------------------------------------------


def test_example_inputs_exercise_the_split() -> None:
    """What this model's example inputs must hold for the SP suites (tests/dit/test_off_parity.py checks every
    case's are reproducible forward arguments and runs them through upstream)."""
    from runtime.diffusion.conditions.example_inputs import example_inputs

    inputs = example_inputs("auraflow", TINY, torch.Generator().manual_seed(0))
    h, w = inputs["hidden_states"].shape[-2:]
    tokens = (h // 2) * (w // 2)
    assert tokens % 2 and tokens % 4  # every SP run pads
    text = inputs["encoder_hidden_states"]
    assert not text[-1, -3:].any() and text[0].abs().min() > 0  # the last sample's padded tokens are zeros
    assert ((inputs["timestep"] >= 0) & (inputs["timestep"] <= 1)).all()


PLAN = Path(__file__).resolve().parents[2] / "runtime" / "plan" / "configs" / "auraflow-0.3.yaml"


def test_plan_config_names_every_parameter_of_the_diffusers_class() -> None:
    import yaml

    config = yaml.safe_load(PLAN.read_text())["model"]["config"]
    signature = inspect.signature(AuraFlowTransformer2DModel.__init__).parameters
    assert set(config) == set(signature) - {"self"}
    # AuraFlow v0.3 is the class's defaults (AuraFlow v0.1's) but for its larger learned position table (96 x 96)
    assert {k for k, v in config.items() if v != signature[k].default} == {"pos_embed_max_size"}
    assert config["pos_embed_max_size"] == 96 * 96


def test_plan_inputs_fit_the_transformer() -> None:
    """``dit_inputs``' auraflow branch (8x VAE, unpacked latents, patch 2) on a small workload and the tiny config:
    the upstream transformer takes them and returns latents of the same shape; the token count is its patchify's."""
    from diffusers.configuration_utils import FrozenDict

    from runtime.plan.config import PlanModel, Workload
    from runtime.plan.dit_inputs import dit_inputs

    inputs, tokens = dit_inputs(
        PlanModel(type="auraflow"), FrozenDict(TINY), Workload(height=64, width=96, text_tokens=9)
    )
    assert inputs["hidden_states"].shape == (1, TINY["in_channels"], 8, 12) and tokens == 4 * 6
    assert inputs["encoder_hidden_states"].shape == (1, 9, TINY["joint_attention_dim"])
    assert 0 <= float(inputs["timestep"]) <= 1
    torch.manual_seed(0)
    out = AuraFlowTransformer2DModel(**TINY)(**inputs)[0]
    assert out.shape == inputs["hidden_states"].shape


def test_plan_file_reads_once_auraflow_is_generated() -> None:
    from runtime.models.registry import REGISTRY

    if "auraflow" not in REGISTRY:
        pytest.skip("no generated auraflow model yet (specs/auraflow.toml): read_plan checks model.type against it")
    from runtime.plan.config import read_plan

    plan = read_plan(PLAN)
    assert plan.model.type == "auraflow" and plan.workload.text_tokens == TEXT_LENGTH
