"""Condition models and pipelines, on tiny random pipeline directories saved with diffusers (no downloads).

* the condition model's training inputs are what the diffusers pipeline feeds the transformer for the same prompt
  (and first frame, Wan I2V), recorded from a real pipeline call;
* a pipeline with the shell's saved (pure diffusers) transformer swapped in produces the same latents as the
  in-memory shell;
* a pipeline holding the generated class (shell or patched diffusers class) saves a ``model_index.json`` that plain
  ``DiffusionPipeline.from_pretrained`` loads back.

Every DiT spec's tiny cases (tests/dit/cases.py) run through all three; the per-model facts (pipeline class,
example pixels, call arguments) come from its condition model.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch

from runtime.diffusion.conditions import ConditionModel, load_condition_model
from tests.dit.cases import CASES, Case

PROMPT = "a small boat on a quiet lake"
# forward kwargs a pipeline passes that are not training inputs
PIPELINE_ONLY = {"attention_kwargs", "joint_attention_kwargs", "return_dict"}
NAMES = sorted(CASES)


def _pixels(case: Case, seed: int = 0) -> torch.Tensor:
    shape = case.condition_class.example_pixels
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _record_calls(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The kwargs of every forward call of ``model`` (the pipeline's conditional branch comes first)."""
    calls: list[dict[str, Any]] = []
    names = list(inspect.signature(model.forward).parameters)  # positional arguments (Sana's latents) by name
    model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append({**dict(zip(names, args, strict=False)), **kwargs}), with_kwargs=True
    )
    return calls


def _pipeline(case: Case, directory: Path, transformer: torch.nn.Module) -> Any:
    return case.condition_class.tiny_pipeline_class(case.variant).from_pretrained(directory, transformer=transformer)


def _run(pipe: Any, case: Case, cm: ConditionModel, pixels: torch.Tensor) -> torch.Tensor:
    out = pipe(
        prompt=PROMPT,
        height=pixels.shape[-2],
        width=pixels.shape[-1],
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(7),
        **case.condition_class.pipeline_call,
        **cm.pipeline_inputs(pixels),
    )
    return out.frames if case.condition_class.video else out.images


def _expected_latents(pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """The normalization each pipeline undoes before decoding, applied to the VAE posterior's mode, written from
    the VAE's config (per-channel mean/std; shift and scale; scale alone) independently of the condition models."""
    vae, config = pipe.vae, pipe.vae.config
    image_vae = isinstance(vae, (diffusers.AutoencoderKL, diffusers.AutoencoderDC))  # 2-D; the others: videos
    video = pixels if pixels.dim() == 4 or image_vae else pixels[:, None]
    with torch.no_grad():
        encoded = vae.encode(video[None])
        # DC-AE (Sana) encodes deterministically: its output is the latent itself
        z = (encoded.latent if hasattr(encoded, "latent") else encoded.latent_dist.mode())[0]
    shape = (-1,) + (1,) * (z.dim() - 1)
    if getattr(config, "latents_mean", None) is not None:
        z = (z - torch.tensor(config.latents_mean).view(shape)) / torch.tensor(config.latents_std).view(shape)
    elif isinstance(getattr(vae, "latents_mean", None), torch.Tensor):  # LTX-Video: the statistics are VAE buffers
        z = (z - vae.latents_mean.view(shape)) * config.scaling_factor / vae.latents_std.view(shape)
    else:
        z = (z - (getattr(config, "shift_factor", None) or 0.0)) * config.scaling_factor
    return z if z.dim() == pixels.dim() else z[:, 0]


@pytest.mark.parametrize("name", NAMES)
def test_condition_model_feeds_what_the_pipeline_feeds(name: str, tiny_pipelines) -> None:
    case = CASES[name]
    directory = tiny_pipelines(name)
    cm = load_condition_model(case.shell_class.config_class.default_condition_model_type, directory)
    assert not any(p.requires_grad for p in cm.parameters()) and not cm.training
    pixels = _pixels(case)
    cond = cm.get_condition([PROMPT], [pixels])
    assert len(cond["latents"]) == len(cond["context"]) == 1

    transformer = case.shell_class.from_pretrained(directory, subfolder="transformer")
    calls = _record_calls(transformer)
    pipe = _pipeline(case, directory, transformer)
    _run(pipe, case, cm, pixels)
    seen, context = calls[0], cond["context"][0]
    for key, value in context.items():  # every per-sample tensor the pipeline passes too (text may be padded there)
        if key in seen:
            got = seen[key][0]
            assert torch.equal(got[: value.shape[0]] if got.dim() else got, value), key
    assert "encoder_hidden_states" in context and "encoder_hidden_states" in seen
    if "condition" in context:  # Wan I2V: the first-frame mask + latents the pipeline concatenates
        z = cond["latents"][0].shape[0]
        assert torch.equal(seen["hidden_states"][0, z:], context["condition"])
    if "first_frame_latents" in context:  # Wan2.2 TI2V: the first latent frame is the image's clean latents
        assert torch.equal(seen["hidden_states"][0][:, :1], context["first_frame_latents"])
    expected = _expected_latents(pipe, pixels)
    if case.condition_class.video and cond["latents"][0].shape != expected.shape:  # CogVideoX: (F, C, h, w)
        expected = expected.transpose(0, 1)
    assert torch.equal(cond["latents"][0], expected)

    inputs = cm.process_condition(cond["latents"], cond["context"], torch.Generator().manual_seed(3))
    assert set(inputs) <= set(inspect.signature(transformer.forward).parameters)
    given = {k for k, v in seen.items() if v is not None} - PIPELINE_ONLY
    assert given == {k for k, v in inputs.items() if v is not None}
    for key in ("img_ids", "txt_ids", "img_shapes", "guidance"):
        if key in inputs:
            assert (torch.equal if key != "img_shapes" else list.__eq__)(inputs[key], seen[key]), key
    # per-sample or per-token timesteps (Wan2.2 TI2V: one per token, the conditioned first frame's at 0), as the call
    assert inputs["timestep"].shape[1:] == seen["timestep"].shape[1:]
    if inputs["timestep"].dim() == 2:
        assert torch.equal(inputs["timestep"][0] == 0, seen["timestep"][0] == 0)
    out = transformer(**inputs, return_dict=False)[0]
    assert out.shape == inputs.target.shape
    objective = getattr(cm, "objective", None)  # DDPM (PixArt): a learned variance doubles the output's channels
    trained = objective.predicted(out) if objective is not None else out
    assert trained.shape == (inputs["hidden_states"][:, : trained.shape[1]]).shape

    # batches: two samples (Qwen-Image prompts of different lengths are padded and masked)
    pair = cm.get_condition([PROMPT, "red"], [pixels, _pixels(case, 1)])
    batch = cm.process_condition(pair["latents"], pair["context"], torch.Generator().manual_seed(4))
    x0 = torch.stack(pair["latents"])
    packed = batch["hidden_states"].dim() != x0.dim()  # Flux, Qwen-Image: 2x2 patches packed into tokens
    target = cm.prediction_to_latents(batch.target, x0.shape[1:])  # unpacked; Lumina2's x0 - noise as noise - x0
    s = batch.sigmas.view(-1, *([1] * (x0.dim() - 1))).double()
    noisy = _unpack(batch["hidden_states"], x0, cm) if packed else batch["hidden_states"][:, : x0.shape[1]]
    x0, target, noisy = x0.double(), target.double(), noisy.double()
    if case.condition_class.prediction == "flow":  # x_s = (1 - s) x0 + s noise, target noise - x0
        noise = x0 + target
        expected = (1 - s) * x0 + s * noise
    elif case.condition_class.prediction == "epsilon":  # DDPM: x_t = a x0 + s noise, a = sqrt(1 - s^2), target noise
        noise = target
        expected = (1 - s**2).sqrt() * x0 + s * noise
    else:  # v: x_t = a x0 + s noise with a = sqrt(1 - s^2), target a noise - s x0
        a = (1 - s**2).sqrt()
        noise = (target + s * x0) / a
        expected = a * x0 + s * noise
    given = getattr(batch, "loss_mask", None)  # latents the model is given (TI2V's first frame), not noised
    if given is not None:
        keep = given.bool()[:, : noisy.shape[1]]  # PixArt: the noise channels of [noise, variance]
        noisy, expected = noisy[keep], expected[keep]
    assert torch.allclose(noisy, expected, atol=1e-5)
    assert transformer(**batch, return_dict=False)[0].shape == batch.target.shape


def _unpack(tokens: torch.Tensor, like: torch.Tensor, cm: ConditionModel) -> torch.Tensor:
    """Image tokens packed 2x2 (Flux, Qwen-Image), written out here; video tokens (LTX-Video: the pipeline's
    ``_pack_latents`` with the transformer's patch sizes) through the condition model's own unpacking, which
    tests/conditions/test_ltx_video.py holds to the pipeline's."""
    if like.dim() == 5:
        return cm.prediction_to_latents(tokens, like.shape[1:])
    b, c, h, w = like.shape
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_with_saved_transformer_matches_in_memory(name: str, tiny_pipelines, tmp_path: Path) -> None:
    case = CASES[name]
    directory = tiny_pipelines(name)
    cm = load_condition_model(case.shell_class.config_class.default_condition_model_type, directory)
    model = case.shell_class.from_pretrained(directory, subfolder="transformer")
    with torch.no_grad():  # weights the pipeline directory does not have
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    model.save_pretrained(tmp_path / "transformer")
    plain = case.upstream_class.from_pretrained(tmp_path / "transformer")
    assert type(plain).__module__.startswith("diffusers.")
    for param in plain.parameters():  # see test_checkpoint._realigned: same values, BLAS-friendly addresses
        param.data = param.data.clone()

    pixels = _pixels(case, 1)
    ours = _run(_pipeline(case, directory, model), case, cm, pixels)
    theirs = _run(_pipeline(case, directory, plain), case, cm, pixels)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_a_pipeline_holding_the_generated_class_saves_and_reloads(name: str, tiny_pipelines, tmp_path: Path) -> None:
    """``pipe.save_pretrained`` records the generated class in model_index.json so that plain
    ``DiffusionPipeline.from_pretrained`` loads it back (diffusers' custom-component route), same outputs."""
    case = CASES[name]
    directory = tiny_pipelines(name)
    cm = load_condition_model(case.shell_class.config_class.default_condition_model_type, directory)
    pixels = _pixels(case, 2)
    for cls in (case.shell_class, case.shell_class.config_class.diffusers_class):  # the shell, the patched class
        model = cls.from_pretrained(directory, subfolder="transformer")
        pipe = _pipeline(case, directory, model)
        pipe.save_pretrained(tmp_path / cls.__name__)
        again = diffusers.DiffusionPipeline.from_pretrained(tmp_path / cls.__name__)
        assert type(again) is type(pipe) and type(again.transformer) is cls
        assert torch.equal(_run(again, case, cm, pixels), _run(pipe, case, cm, pixels))
