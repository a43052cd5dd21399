"""The Ovis-Image condition model against diffusers' own ``OvisImagePipeline`` on a tiny pipeline saved and loaded
with the real loading code (upstream transformer, no spec): the prompt embeddings are the pipeline's
``encode_prompt`` (chat template, system prompt, the first 28 tokens dropped), and the transformer's inputs are laid
out as the pipeline's denoising loop passes them (packed latents, image and text positions), bitwise; the latents
unpack as the pipeline unpacks them; a trainer reading the cache (no encoders) has the same recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import OvisImagePipeline, OvisImageTransformer2DModel

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.ovis_image import TEXT_LENGTH, OvisImageConditionModel
from tests.conditions.common import assert_cached_context_suffices, save_tiny_pipeline

# draft's tiny config of OvisImageTransformer2DModel (docs/adding-a-model.md: 4 heads of 16, 4 latent channels)
TINY: dict[str, Any] = {
    "num_layers": 1,
    "num_single_layers": 1,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "joint_attention_dim": 32,
    "axes_dims_rope": [4, 6, 6],
}
PROMPTS = ["a small boat on a quiet lake", "red"]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ovis_image")
    return save_tiny_pipeline(OvisImagePipeline, OvisImageConditionModel, OvisImageTransformer2DModel, TINY, path)


@pytest.fixture(scope="module")
def cm(directory: Path) -> OvisImageConditionModel:
    model = load_condition_model("ovis_image", directory)
    assert isinstance(model, OvisImageConditionModel) and model.guidance_scale is None  # no guidance embedding
    return model


def test_prompts_are_the_pipelines_embeddings(cm: OvisImageConditionModel) -> None:
    theirs, _, text_ids, _ = cm.pipeline.encode_prompt(
        PROMPTS, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH
    )
    ours = cm.encode_prompts(PROMPTS)
    assert theirs.shape == (2, TEXT_LENGTH, TINY["joint_attention_dim"]) and theirs.abs().sum() > 0
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine["encoder_hidden_states"], reference.float())
    inputs = cm.transformer_inputs(torch.zeros(2, 1, 4, 6), ours, torch.tensor([0.5, 0.5]))
    assert torch.equal(inputs["txt_ids"], text_ids)


def test_transformer_inputs_are_the_pipelines(cm: OvisImageConditionModel, directory: Path) -> None:
    """One denoising step of the pipeline without CFG from our packed latents: every tensor the transformer gets
    equals ``transformer_inputs`` at the pipeline's noise level."""
    transformer = OvisImageTransformer2DModel.from_pretrained(directory, subfolder="transformer")
    pipeline = OvisImagePipeline.from_pretrained(directory, transformer=transformer)
    seen: dict[str, Any] = {}
    transformer.register_forward_pre_hook(lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True)
    latents = torch.randn(1, 1, 4, 6, generator=torch.Generator().manual_seed(1))
    packed = cm.latents_to_prediction(latents)
    pipeline(PROMPTS[0], height=32, width=48, num_inference_steps=1, guidance_scale=1.0, latents=packed.clone())
    ours = cm.transformer_inputs(latents, cm.encode_prompts(PROMPTS[:1]), seen["timestep"])
    for key, value in ours.items():
        assert torch.equal(seen[key], value), key
    assert torch.equal(cm.prediction_to_latents(packed, latents.shape[1:]), latents)
    assert torch.equal(pipeline._unpack_latents(packed, 32, 48, pipeline.vae_scale_factor), latents)


def test_a_cached_context_suffices(cm: OvisImageConditionModel, directory: Path) -> None:
    bare = load_condition_model("ovis_image", directory, encoders=False)
    x0 = list(torch.randn(1, 1, 4, 6, generator=torch.Generator().manual_seed(4)))
    assert_cached_context_suffices(cm, bare, x0, PROMPTS[1])


def test_example_inputs_are_laid_out_as_the_condition_model_lays_them_out(cm: OvisImageConditionModel) -> None:
    """The builder the start-up self-check and the suites feed (``example_inputs``): the condition model's keys and
    positions, 15 image tokens (sp = 2 and 4 do not divide them)."""
    from runtime.diffusion.conditions.example_inputs import example_inputs

    example = example_inputs("ovis_image", TINY, torch.Generator().manual_seed(0))
    context = [{"encoder_hidden_states": text} for text in example["encoder_hidden_states"]]
    ours = cm.transformer_inputs(torch.zeros(2, 1, 6, 10), context, example["timestep"])
    assert set(example) == set(ours) | {"return_dict"}
    assert example["hidden_states"].shape == ours["hidden_states"].shape == (2, 15, TINY["in_channels"])
    for key in ("txt_ids", "img_ids", "encoder_hidden_states", "timestep"):
        assert torch.equal(example[key], ours[key]), key
