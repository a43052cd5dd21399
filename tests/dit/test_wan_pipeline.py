"""Wan condition model and pipelines, on tiny random pipeline directories saved with diffusers (no downloads).

* the condition model's training inputs are what the diffusers pipeline feeds the transformer for the same prompt
  (and first frame, I2V), recorded from a real pipeline call;
* a pipeline with the shell's saved (pure diffusers) transformer swapped in produces the same latents as the
  in-memory shell.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

from generated.wan.transformer_wan import WanTransformer3DModelForTraining
from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.wan import _to_pil

KINDS = {"wan_t2v": WanPipeline, "wan_i2v": WanImageToVideoPipeline}
PROMPT = "a small boat on a quiet lake"
FRAMES, SIZE = 5, 32  # 5 frames -> 2 latent frames; 32 px -> 4x4 latents -> 2x2 tokens per frame


def _video(seed: int = 0) -> torch.Tensor:
    return torch.rand(3, FRAMES, SIZE, SIZE, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _record_calls(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The kwargs of every forward call of ``model`` (the pipeline's conditional branch comes first)."""
    calls: list[dict[str, Any]] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def _run(pipe: Any, kind: str, video: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    extra = {"image": _to_pil(video[:, 0])} if kind == "wan_i2v" else {}
    return pipe(
        prompt=PROMPT,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=3.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(7),
        **extra,
        **kwargs,
    ).frames


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_condition_model_feeds_what_the_pipeline_feeds(kind: str, tiny_pipelines) -> None:
    directory = tiny_pipelines(kind)
    cm = load_condition_model("wan", directory)
    assert cm.i2v == (kind == "wan_i2v")
    assert not any(p.requires_grad for p in cm.parameters()) and not cm.training
    video = _video()
    cond = cm.get_condition([PROMPT], [video])
    assert len(cond["latents"]) == len(cond["context"]) == 1

    transformer = WanTransformer3DModelForTraining.from_pretrained(directory, subfolder="transformer")
    calls = _record_calls(transformer)
    pipe = KINDS[kind].from_pretrained(directory, transformer=transformer)
    _run(pipe, kind, video)
    seen = calls[0]
    context = cond["context"][0]
    assert torch.equal(seen["encoder_hidden_states"][0], context["encoder_hidden_states"])
    if kind == "wan_i2v":
        assert torch.equal(seen["encoder_hidden_states_image"][0], context["encoder_hidden_states_image"])
        z = cond["latents"][0].shape[0]
        assert torch.equal(seen["hidden_states"][0, z:], context["condition"])  # mask + first-frame latents

    # the latents are the VAE posterior's mode, normalized with the VAE config's per-channel mean/std
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    with torch.no_grad():
        expected = (vae.encode(video[None]).latent_dist.mode()[0] - mean) / std
    assert torch.equal(cond["latents"][0], expected)

    inputs = cm.process_condition(cond["latents"] * 2, cond["context"] * 2, torch.Generator().manual_seed(3))
    assert set(inputs) <= set(inspect.signature(transformer.forward).parameters)
    assert seen.keys() - {"attention_kwargs", "return_dict"} == set(inputs)
    x0 = torch.stack(cond["latents"] * 2)
    s = inputs.sigmas.view(-1, 1, 1, 1, 1)
    noise = inputs.target + x0
    z = x0.shape[1]
    assert torch.allclose(inputs["hidden_states"][:, :z], (1 - s) * x0 + s * noise, atol=1e-6)
    assert torch.equal(inputs["timestep"], inputs.sigmas * 1000)
    out = transformer(**inputs, return_dict=False)[0]
    assert out.shape == inputs.target.shape


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pipeline_with_saved_transformer_matches_in_memory(kind: str, tiny_pipelines, tmp_path: Path) -> None:
    directory = tiny_pipelines(kind)
    model = WanTransformer3DModelForTraining.from_pretrained(directory, subfolder="transformer")
    with torch.no_grad():  # weights the pipeline directory does not have
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    model.save_pretrained(tmp_path / "transformer")
    plain = WanTransformer3DModel.from_pretrained(tmp_path / "transformer")
    for param in plain.parameters():  # see test_checkpoint._realigned: same values, BLAS-friendly addresses
        param.data = param.data.clone()

    video = _video(1)
    ours = _run(KINDS[kind].from_pretrained(directory, transformer=model), kind, video)
    theirs = _run(KINDS[kind].from_pretrained(directory, transformer=plain), kind, video)
    assert torch.equal(ours, theirs)
