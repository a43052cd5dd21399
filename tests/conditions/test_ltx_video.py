"""The LTX-Video condition model against the real ``LTXPipeline``, without the spec: its tiny components around an
upstream tiny ``LTXVideoTransformer3DModel``, saved with ``save_pretrained`` and loaded with the real loading code.

* prompts: ``encode_prompts`` is exactly ``pipe.encode_prompt`` (T5, 128 tokens, boolean mask);
* latents: the pipeline's ``_normalize_latents`` of the VAE posterior's mode (the VAE's ``latents_mean`` /
  ``latents_std`` buffers and ``scaling_factor``), packed by ``_pack_latents``; the transformer's inputs are the keys
  and values the pipeline passes (latent grid, ``rope_interpolation_scale``, ``timestep = t``);
* the ODE path: denoising with ``sampling_schedule``, ``transformer_inputs``, ``combine_guidance``,
  ``prediction_to_latents`` and ``scheduler.step`` is bitwise the pipeline's ``output_type="latent"`` call from the
  same noise, with and without CFG (the scheduler's dynamic shift of the token count and its ``shift_terminal``);
  the Flow-GRPO rollout (``DiTFlowGRPO``, CFG batched ``[negative; conditional]`` as the pipeline batches it) too;
* the sign: a transformer that outputs ``process_condition``'s target brings the pipeline itself to x0;
* the training noise levels are finetrainers' LTX recipe (module doc of ``runtime/diffusion/conditions/ltx_video.py``);
* the example inputs (per-token timesteps) run the upstream transformer; a constant per-token timestep is the
  per-sample one; the FSDP2 units are the spec's blocks (diffusers 0.40.0's class declares none);
* the plan file's config is complete and its inputs fit.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.ltx_video import TEXT_LENGTH, LTXVideoConditionModel
from tests.conditions.common import assert_cached_context_suffices, ode_rollout, save_tiny_pipeline

# the tiny transformer (specs/ltx_video.toml's [model.tiny])
TINY: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 4,
    "attention_head_dim": 8,
    "cross_attention_dim": 32,
    "num_layers": 2,
    "caption_channels": 16,
}
PROMPT = "a small boat on a quiet lake"
NEGATIVE = "blurry"
HEIGHT, WIDTH, FRAMES = 64, 96, 9  # 2 latent frames of 2x3: 12 tokens
STEPS = 3


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ltx_video")
    return save_tiny_pipeline(LTXPipeline, LTXVideoConditionModel, LTXVideoTransformer3DModel, TINY, path)


@pytest.fixture(scope="module")
def cm(directory: Path) -> LTXVideoConditionModel:
    model = load_condition_model("ltx_video", directory)
    assert isinstance(model, LTXVideoConditionModel)
    return model


def _pipe(directory: Path, **components: Any) -> LTXPipeline:
    pipe = LTXPipeline.from_pretrained(directory, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _record(model: torch.nn.Module) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def _noise(cm: LTXVideoConditionModel, seed: int = 5) -> torch.Tensor:
    shape = cm.sampling_latent_shape(HEIGHT, WIDTH, FRAMES)
    return torch.randn(1, *shape, generator=torch.Generator().manual_seed(seed))


def _call(pipe: LTXPipeline, cm: LTXVideoConditionModel, noise: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline from ``noise`` (unpacked; the pipeline takes its latents packed), its packed final latents."""
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=scale,
        latents=cm.latents_to_prediction(noise.clone()),
        output_type="latent",
    ).frames


# ---- prompts and latents --------------------------------------------------------------------------------------------


def test_encode_prompts_is_the_pipelines(cm: LTXVideoConditionModel, directory: Path) -> None:
    pipe = _pipe(directory)
    prompts = [PROMPT, "red"]
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    ours = cm.encode_prompts(prompts)
    assert len(ours) == 2
    for i, context in enumerate(ours):
        assert set(context) == {"encoder_hidden_states", "encoder_attention_mask"}
        assert torch.equal(context["encoder_hidden_states"], embeds[i].float())
        assert torch.equal(context["encoder_attention_mask"], mask[i]) and mask.dtype == torch.bool
        assert context["encoder_hidden_states"].shape == (TEXT_LENGTH, TINY["caption_channels"])
    lengths = [int(c["encoder_attention_mask"].sum()) for c in ours]
    assert lengths[0] > lengths[1] > 0
    # the negative prompt is encoded like a prompt (the pipeline's _get_t5_prompt_embeds for both)
    _, _, neg_embeds, neg_mask = pipe.encode_prompt([PROMPT], negative_prompt=[NEGATIVE])
    negative = cm.encode_negative_prompts([NEGATIVE])[0]
    assert torch.equal(negative["encoder_hidden_states"], neg_embeds[0].float())
    assert torch.equal(negative["encoder_attention_mask"], neg_mask[0])
    # one prompt alone encodes as in the batch (what the rollout and the condition cache rely on)
    assert torch.equal(cm.encode_prompts(["red"])[0]["encoder_hidden_states"], ours[1]["encoder_hidden_states"])


def test_latents_and_inputs_are_what_the_pipeline_feeds(cm: LTXVideoConditionModel, directory: Path) -> None:
    pipe = _pipe(directory)
    pixels = torch.rand(3, FRAMES, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(1)) * 2 - 1
    cond = cm.get_condition([PROMPT], [pixels])
    vae = pipe.vae
    assert not torch.equal(vae.latents_mean, torch.zeros_like(vae.latents_mean))  # the tiny VAE's statistics
    assert vae.config.scaling_factor != 1.0
    with torch.no_grad():
        z = vae.encode(pixels[None]).latent_dist.mode()
    expected = LTXPipeline._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)[0]
    assert torch.equal(cond["latents"][0], expected)
    assert cond["latents"][0].shape == cm.sampling_latent_shape(HEIGHT, WIDTH, FRAMES) == (8, 2, 2, 3)

    calls = _record(pipe.transformer)
    _call(pipe, cm, _noise(cm), 1.0)
    seen = calls[0]
    for key, value in cond["context"][0].items():
        assert torch.equal(seen[key][0], value), key
    inputs = cm.process_condition(cond["latents"], cond["context"], torch.Generator().manual_seed(3))
    given = {k for k, v in seen.items() if v is not None} - {"attention_kwargs", "return_dict"}
    assert set(inputs) == given
    assert set(inputs) <= set(inspect.signature(LTXVideoTransformer3DModel.forward).parameters)
    for key in ("num_frames", "height", "width", "rope_interpolation_scale"):
        assert inputs[key] == seen[key], key
    assert inputs["rope_interpolation_scale"] == (8 / 25, 32, 32)
    assert inputs["timestep"].shape == seen["timestep"].shape == (1,)
    # packing: the pipeline's _pack_latents with the transformer's patch sizes
    s = inputs.sigmas.view(-1, 1, 1, 1, 1)
    noise = cm.prediction_to_latents(inputs.target, expected.shape) + expected[None]
    noisy = (1 - s) * expected[None] + s * noise
    torch.testing.assert_close(inputs["hidden_states"], LTXPipeline._pack_latents(noisy), rtol=0, atol=1e-6)
    assert torch.equal(inputs.target, LTXPipeline._pack_latents(noise - expected[None]))
    assert torch.equal(inputs["timestep"], inputs.sigmas * 1000)
    assert pipe.transformer(**inputs, return_dict=False)[0].shape == inputs.target.shape
    # decoding: the pipeline's denormalisation and VAE call (output_type="pt" post-processes to [0, 1])
    decoded = cm.decode_latents(cond["latents"][0][None])
    with torch.no_grad():
        x = LTXPipeline._denormalize_latents(
            cond["latents"][0][None], vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
        theirs = vae.decode(x, None, return_dict=False)[0]
    assert torch.equal(decoded, theirs.clamp(-1, 1)) and decoded.shape == (1, *pixels.shape)


def test_without_encoders_process_condition_runs_from_cached_context(
    cm: LTXVideoConditionModel, directory: Path
) -> None:
    """``encoders=False`` (a trainer reading the condition cache): the scheduler only, the same recipe, and the VAE's
    ratios and latent channels read from its config file."""
    bare = load_condition_model("ltx_video", directory, encoders=False)
    assert (bare.patch, bare.rope_interpolation_scale, bare.latent_channels) == (
        cm.patch,
        cm.rope_interpolation_scale,
        cm.latent_channels,
    )
    x0 = [torch.randn(8, 2, 2, 3, generator=torch.Generator().manual_seed(0))]
    assert_cached_context_suffices(cm, bare, x0, PROMPT)
    other = load_condition_model("ltx_video", directory, encoders=False, frame_rate=24)
    assert other.rope_interpolation_scale == (8 / 24, 32, 32)


# ---- the ODE path ------------------------------------------------------------------------------------------------


def _denoise(cm: LTXVideoConditionModel, transformer: torch.nn.Module, noise: torch.Tensor, scale: float) -> Any:
    """The pipeline's loop written with the condition model's hooks (CFG as one batch [negative; conditional], as
    the pipeline batches it)."""
    shape = noise.shape[1:]
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(cm.pipeline.scheduler.config)
    scheduler.set_timesteps(**cm.sampling_schedule(STEPS, shape))
    context = cm.encode_prompts([PROMPT])
    negative = cm.encode_negative_prompts([NEGATIVE])
    latents, timesteps = noise.clone(), []
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            sigmas = scheduler.sigmas[i].expand(latents.shape[0])
            if scale > 1:
                both = torch.cat([sigmas, sigmas])
                inputs = cm.transformer_inputs(torch.cat([latents, latents]), negative + context, both)
                uncond, cond = transformer(**inputs, return_dict=False)[0].float().chunk(2)
                out = cm.combine_guidance(cond, uncond, scale)
            else:
                inputs = cm.transformer_inputs(latents, context, sigmas)
                out = transformer(**inputs, return_dict=False)[0].float()
            timesteps.append(inputs["timestep"])
            latents = scheduler.step(cm.prediction_to_latents(out, shape), t, latents, return_dict=False)[0]
    return latents, scheduler, timesteps


@pytest.mark.parametrize("scale", [1.0, 3.0], ids=["no_cfg", "cfg"])
def test_ode_path_is_the_pipelines(cm: LTXVideoConditionModel, directory: Path, scale: float) -> None:
    pipe = _pipe(directory)
    noise = _noise(cm)
    calls = _record(pipe.transformer)
    out = _call(pipe, cm, noise, scale)
    ours, scheduler, timesteps = _denoise(cm, pipe.transformer, noise, scale)
    assert torch.equal(scheduler.sigmas, pipe.scheduler.sigmas)
    assert torch.equal(scheduler.timesteps, pipe.scheduler.timesteps)
    for i, timestep in enumerate(timesteps):
        assert torch.equal(timestep, calls[i]["timestep"])
    assert torch.equal(cm.latents_to_prediction(ours), out)
    # the shift is the scheduler's dynamic one of the 12 latent tokens (and its shift_terminal): not the grid's
    plain = FlowMatchEulerDiscreteScheduler()
    plain.set_timesteps(sigmas=cm.sampling_schedule(STEPS, noise.shape[1:])["sigmas"])
    assert not torch.equal(plain.sigmas, scheduler.sigmas) and scheduler.sigmas[-2].item() == pytest.approx(0.1)


def test_flowgrpo_rollout_ends_where_the_pipeline_ends(cm: LTXVideoConditionModel, directory: Path) -> None:
    """The RL adapter (true CFG as one batch [negative; conditional], as the pipeline) at noise level 0: bitwise the
    pipeline's ODE path."""
    from runtime.rl.adapters.dit import DiTFlowGRPO

    pipe = _pipe(directory)
    noise = _noise(cm, seed=9)
    adapter = DiTFlowGRPO(cm, noise.shape[1:], true_cfg_scale=3.0, noise_level=0.0)
    res = ode_rollout(adapter, pipe.transformer, noise, PROMPT, NEGATIVE, STEPS)
    out = _call(pipe, cm, noise, 3.0)
    assert torch.equal(adapter.set_timesteps(STEPS).sigmas, pipe.scheduler.sigmas)
    final = cm.latents_to_prediction(res.final_latents)
    assert torch.equal(final, out), ((final.double() - out.double()).norm() / out.double().norm()).item()


# ---- the sign of the prediction ----------------------------------------------------------------------------------


class _Oracle(LTXVideoTransformer3DModel):
    """Outputs a fixed tensor: the training target of one clean sample and its noise."""

    answer: torch.Tensor

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        return (self.answer.expand_as(hidden_states).clone(),)


def test_a_transformer_that_outputs_the_target_brings_the_pipeline_to_x0(
    cm: LTXVideoConditionModel, directory: Path
) -> None:
    """On the straight path from noise to x0 the target ``noise - x0`` is the same at every level: a transformer
    that outputs it makes the pipeline's Euler steps land on x0 (the other sign would end at ``2 noise - x0``)."""
    pipe = _pipe(directory)
    oracle = _Oracle(**TINY)
    noise = _noise(cm, seed=11)
    x0 = torch.randn(noise.shape, generator=torch.Generator().manual_seed(12))
    oracle.answer = cm.latents_to_prediction(noise - x0)
    oracle_pipe = LTXPipeline(
        transformer=oracle,
        scheduler=pipe.scheduler,
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
    )
    oracle_pipe.set_progress_bar_config(disable=True)
    out = _call(oracle_pipe, cm, noise, 1.0)
    torch.testing.assert_close(cm.prediction_to_latents(out, x0.shape[1:]), x0, rtol=0, atol=1e-5)


# ---- noise levels, example inputs, FSDP units, plan ----------------------------------------------------------------


def test_training_noise_levels_are_finetrainers_ltx_recipe(cm: LTXVideoConditionModel) -> None:
    """finetrainers: ``u`` logit-normal(0, 1), sigma = the default scheduler's training sigma at index
    ``int(1000 u)``, i.e. ``1 - u`` on a 1/1000 grid; logit-normal(0, 1) is symmetric about 1/2, so that is the
    unshifted logit-normal level drawn here (the pipeline's dynamic shift is not used at training time)."""
    sampler = cm.sampler
    assert cm.pipeline.scheduler.config.use_dynamic_shifting  # the pipeline samples with a shift...
    assert (sampler.distribution, sampler.logit_mean, sampler.logit_std) == ("logit_normal", 0.0, 1.0)
    assert (sampler.shift, sampler.dynamic, sampler.weighting) == (1.0, False, "none")  # ...training does not
    grid = FlowMatchEulerDiscreteScheduler().sigmas  # finetrainers' scheduler_sigmas
    u = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    theirs = grid[(u * 1000).long()]
    torch.testing.assert_close(theirs, 1 - u, rtol=0, atol=1e-3)
    torch.testing.assert_close(sampler._shifted(u, 12).float(), u, rtol=0, atol=1e-6)
    assert LTXVideoConditionModel.training_sampler(cm.pipeline.scheduler.config, dynamic=True).dynamic


def test_example_inputs_exercise_the_split() -> None:
    """What this model's example inputs must hold for the SP suites (tests/dit/test_off_parity.py checks every
    case's are reproducible forward arguments and runs them through upstream)."""
    from runtime.diffusion.conditions.example_inputs import example_inputs

    inputs = example_inputs("ltx_video", TINY, torch.Generator().manual_seed(0))
    tokens = inputs["num_frames"] * inputs["height"] * inputs["width"]
    assert inputs["hidden_states"].shape[1] == tokens and tokens % 2 and tokens % 4  # every SP run pads
    frame = inputs["height"] * inputs["width"]
    assert inputs["timestep"].shape == (2, tokens) and (inputs["timestep"][:, :frame] == 0).all()
    assert (inputs["timestep"][:, frame:] > 0).all()
    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(**TINY)
    with torch.no_grad():
        out = model(**inputs)[0]
        assert out.shape == inputs["hidden_states"].shape and torch.isfinite(out).all()
        # a constant per-token timestep (finetrainers' (b, L, 1) form) is the per-sample one
        level = torch.tensor([300.0, 700.0])
        per_sample = model(**{**inputs, "timestep": level})[0]
        per_token = model(**{**inputs, "timestep": level[:, None, None].expand(2, tokens, 1)})[0]
    torch.testing.assert_close(per_token, per_sample, rtol=0, atol=1e-6)


def test_fsdp_units_are_the_blocks_the_spec_states() -> None:
    """diffusers 0.40.0's class declares no ``_no_split_modules``, so FSDP2 (and the activation checkpointing that
    wraps the same units) cannot tell its blocks; the generated trainable class declares the spec's
    ``blocks = ["LTXVideoTransformerBlock"]``."""
    from runtime.diffusion.registry import training_class
    from runtime.parallel.fsdp import block_modules

    cls = training_class("ltx_video")
    assert cls._no_split_modules == ["LTXVideoTransformerBlock"]
    torch.manual_seed(0)
    shell = cls(cls.config_class(**TINY))
    blocks = block_modules(shell)
    assert [type(b).__name__ for b in blocks] == ["LTXVideoTransformerBlock"] * TINY["num_layers"]
    assert blocks == list(shell.transformer_blocks)
    with pytest.raises(ValueError, match="declares no _no_split_modules"):
        block_modules(LTXVideoTransformer3DModel(**TINY))


PLAN = Path(__file__).resolve().parents[2] / "runtime" / "plan" / "configs" / "ltx-video-2b.yaml"


def test_plan_config_names_every_parameter_of_the_diffusers_class() -> None:
    """The 2B model is the class's defaults, every one written out (so a changed default cannot move the plan)."""
    import yaml

    config = yaml.safe_load(PLAN.read_text())["model"]["config"]
    signature = inspect.signature(LTXVideoTransformer3DModel.__init__).parameters
    assert set(config) == set(signature) - {"self"}
    assert all(config[k] == p.default for k, p in signature.items() if k != "self")


def test_plan_inputs_fit_the_transformer() -> None:
    """``dit_inputs``' ltx_video branch (8x temporal, 32x spatial, packed, a mask of ones) on a small workload and
    the tiny config: the upstream transformer takes them and returns one prediction per token; the token count is
    the latent grid's, and the inputs are those ``LTXPipeline`` passes."""
    from diffusers.configuration_utils import FrozenDict

    from runtime.plan.config import PlanModel, Workload
    from runtime.plan.dit_inputs import dit_inputs

    inputs, tokens = dit_inputs(
        PlanModel(type="ltx_video"), FrozenDict(TINY), Workload(frames=17, height=64, width=96, text_tokens=9)
    )
    assert tokens == 3 * 2 * 3 and inputs["hidden_states"].shape == (1, tokens, TINY["in_channels"])
    assert (inputs["num_frames"], inputs["height"], inputs["width"]) == (3, 2, 3)
    assert inputs["rope_interpolation_scale"] == (8 / 25, 32, 32)
    assert inputs["encoder_attention_mask"].shape == (1, 9) and bool(inputs["encoder_attention_mask"].all())
    torch.manual_seed(0)
    out = LTXVideoTransformer3DModel(**TINY)(**inputs)[0]
    assert out.shape == inputs["hidden_states"].shape


def test_plan_file_reads() -> None:
    from runtime.plan.config import read_plan

    plan = read_plan(PLAN)
    assert plan.model.type == "ltx_video" and plan.workload.text_tokens == TEXT_LENGTH
    assert (plan.model.vae_scale_factor_spatial, plan.model.vae_scale_factor_temporal) == (32, 8)
