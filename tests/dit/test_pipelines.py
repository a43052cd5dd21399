"""Condition models and pipelines, on tiny random pipeline directories saved with diffusers (no downloads).

* the condition model's training inputs are what the diffusers pipeline feeds the transformer for the same prompt
  (and first frame, Wan I2V), recorded from a real pipeline call;
* a pipeline with the shell's saved (pure diffusers) transformer swapped in produces the same latents as the
  in-memory shell.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.wan import _to_pil
from runtime.diffusion.registry import lookup_dit, training_class

PROMPT = "a small boat on a quiet lake"
# forward kwargs a pipeline passes that are not training inputs
PIPELINE_ONLY = {"attention_kwargs", "joint_attention_kwargs", "return_dict"}


@dataclass(frozen=True)
class Kind:
    pipeline: str  # diffusers pipeline class
    model_type: str
    pixels: tuple[int, ...]  # one training sample's pixels: (C, F, H, W) video or (C, H, W) image
    call: dict[str, Any]


KINDS = {
    # 5 frames -> 2 latent frames; 32 px -> 4x4 latents -> 2x2 tokens per frame
    "wan_t2v": Kind("WanPipeline", "wan", (3, 5, 32, 32), {"num_frames": 5, "guidance_scale": 3.0}),
    "wan_i2v": Kind("WanImageToVideoPipeline", "wan", (3, 5, 32, 32), {"num_frames": 5, "guidance_scale": 3.0}),
    # 32x48 px -> 4x6 latents -> 2x3 packed tokens
    "flux": Kind("FluxPipeline", "flux", (3, 32, 48), {"guidance_scale": 3.5}),
    "qwenimage": Kind("QwenImagePipeline", "qwenimage", (3, 32, 48), {"true_cfg_scale": 1.0}),
}


def _pixels(kind: Kind, seed: int = 0) -> torch.Tensor:
    return torch.rand(*kind.pixels, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _record_calls(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The kwargs of every forward call of ``model`` (the pipeline's conditional branch comes first)."""
    calls: list[dict[str, Any]] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def _pipeline(name: str, directory: Path, transformer: torch.nn.Module) -> Any:
    return getattr(diffusers, name).from_pretrained(directory, transformer=transformer)


def _run(pipe: Any, name: str, pixels: torch.Tensor) -> torch.Tensor:
    kind = KINDS[name]
    extra = {"image": _to_pil(pixels[:, 0])} if name == "wan_i2v" else {}
    out = pipe(
        prompt=PROMPT,
        height=pixels.shape[-2],
        width=pixels.shape[-1],
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(7),
        **kind.call,
        **extra,
    )
    return out.frames if name.startswith("wan") else out.images


def _expected_latents(name: str, pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """The normalization each pipeline undoes before decoding, applied to the VAE posterior's mode."""
    vae = pipe.vae
    with torch.no_grad():
        if name == "flux":
            z = vae.encode(pixels[None]).latent_dist.mode()[0]
            return (z - vae.config.shift_factor) * vae.config.scaling_factor
        video = pixels if name.startswith("wan") else pixels[:, None]
        z = vae.encode(video[None]).latent_dist.mode()[0]
        mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
        z = (z - mean) / std
        return z if name.startswith("wan") else z[:, 0]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_condition_model_feeds_what_the_pipeline_feeds(name: str, tiny_pipelines) -> None:
    kind = KINDS[name]
    directory = tiny_pipelines(name)
    cm = load_condition_model(lookup_dit(kind.model_type).data["condition_model_type"], directory)
    assert not any(p.requires_grad for p in cm.parameters()) and not cm.training
    pixels = _pixels(kind)
    cond = cm.get_condition([PROMPT], [pixels])
    assert len(cond["latents"]) == len(cond["context"]) == 1

    transformer = training_class(kind.model_type).from_pretrained(directory, subfolder="transformer")
    calls = _record_calls(transformer)
    pipe = _pipeline(kind.pipeline, directory, transformer)
    _run(pipe, name, pixels)
    seen, context = calls[0], cond["context"][0]
    text = context["encoder_hidden_states"]
    assert torch.equal(seen["encoder_hidden_states"][0, : text.shape[0]], text)
    for key in ("pooled_projections", "encoder_hidden_states_image"):
        if key in context:
            assert torch.equal(seen[key][0], context[key]), key
    if "condition" in context:  # Wan I2V: the first-frame mask + latents the pipeline concatenates
        z = cond["latents"][0].shape[0]
        assert torch.equal(seen["hidden_states"][0, z:], context["condition"])
    assert torch.equal(cond["latents"][0], _expected_latents(name, pipe, pixels))

    inputs = cm.process_condition(cond["latents"], cond["context"], torch.Generator().manual_seed(3))
    assert set(inputs) <= set(inspect.signature(transformer.forward).parameters)
    given = {k for k, v in seen.items() if v is not None} - PIPELINE_ONLY
    assert given == {k for k, v in inputs.items() if v is not None}
    for key in ("img_ids", "txt_ids", "img_shapes", "guidance"):
        if key in inputs:
            assert (torch.equal if key != "img_shapes" else list.__eq__)(inputs[key], seen[key]), key
    out = transformer(**inputs, return_dict=False)[0]
    assert out.shape == inputs.target.shape == (inputs["hidden_states"][:, : out.shape[1]]).shape

    # batches: two samples (Qwen-Image prompts of different lengths are padded and masked)
    pair = cm.get_condition([PROMPT, "red"], [pixels, _pixels(kind, 1)])
    batch = cm.process_condition(pair["latents"], pair["context"], torch.Generator().manual_seed(4))
    x0 = torch.stack(pair["latents"])
    noise = x0 + (batch.target if name.startswith("wan") else _unpack(batch.target, x0))
    s = batch.sigmas.view(-1, *([1] * (x0.dim() - 1)))
    noisy = batch["hidden_states"][:, : x0.shape[1]] if name.startswith("wan") else _unpack(batch["hidden_states"], x0)
    assert torch.allclose(noisy, (1 - s) * x0 + s * noise, atol=1e-6)
    assert transformer(**batch, return_dict=False)[0].shape == batch.target.shape


def _unpack(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    b, c, h, w = like.shape
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_pipeline_with_saved_transformer_matches_in_memory(name: str, tiny_pipelines, tmp_path: Path) -> None:
    kind = KINDS[name]
    directory = tiny_pipelines(name)
    model = training_class(kind.model_type).from_pretrained(directory, subfolder="transformer")
    with torch.no_grad():  # weights the pipeline directory does not have
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    model.save_pretrained(tmp_path / "transformer")
    plain = lookup_dit(kind.model_type).upstream_class().from_pretrained(tmp_path / "transformer")
    assert type(plain).__module__.startswith("diffusers.")
    for param in plain.parameters():  # see test_checkpoint._realigned: same values, BLAS-friendly addresses
        param.data = param.data.clone()

    pixels = _pixels(kind, 1)
    ours = _run(_pipeline(kind.pipeline, directory, model), name, pixels)
    theirs = _run(_pipeline(kind.pipeline, directory, plain), name, pixels)
    assert torch.equal(ours, theirs)
