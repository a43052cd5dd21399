"""Generated VLMs with parallelism off are bitwise equal to upstream: logits, loss (MoE: and the aux loss) and
every gradient (vision tower, deepstack mergers, windowed ViT, text model, experts and router), with two images in
one sample."""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import lookup, model_types, variant_cases, variant_overrides
from tests.parity.dense import grads
from tests.parity.vlm import GRIDS, vlm_batch, vlm_models

VLMS = model_types("vlm")
DEEPSTACK = set(model_types("vlm", capability="deepstack"))


@pytest.mark.parametrize(("model_type", "variant"), variant_cases(VLMS))  # each tiny variant's branches too
def test_vlm_bitwise_equal_to_upstream(model_type: str, variant: str | None) -> None:
    upstream, generated = vlm_models(model_type, **variant_overrides(model_type, variant))
    assert type(generated).__module__ == f"generated.{model_type}.modeling_{model_type}"
    # the sub-models are the generated (patched) classes, not upstream's via AutoModel
    assert type(generated.model.visual).__module__ == type(generated).__module__
    assert type(generated.model.language_model).__module__ == type(generated).__module__
    batch = vlm_batch(model_type)
    assert len(batch["image_grid_thw"]) == len(GRIDS) == 2
    moe = lookup(model_type).is_moe
    # MoE: upstream adds the load-balancing loss only when asked per call; the router gets its gradient too
    kwargs = {"output_router_logits": True} if moe else {}
    outputs = [m(**batch, **kwargs) for m in (upstream, generated)]
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    if moe:
        assert outputs[0].aux_loss is not None and outputs[0].aux_loss > 0
        assert torch.equal(outputs[0].aux_loss, outputs[1].aux_loss)
    for out in outputs:
        out.loss.backward()
    ref, got = grads(upstream), grads(generated)
    assert ref.keys() == got.keys()
    # every patched path carries gradient: the ViT, every deepstack merger, the text layers
    if model_type in DEEPSTACK:
        assert any(n.startswith("model.visual.deepstack_merger_list.1.") for n in ref)
    if moe:
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in ref)
        assert any(n.endswith("mlp.gate.weight") for n in ref)
    for name in ref:
        assert ref[name].abs().sum() > 0, name
        assert torch.equal(ref[name], got[name]), name


@pytest.mark.parametrize("model_type", VLMS)
def test_pipeline_position_ids_are_upstreams_layout(model_type: str) -> None:
    """The data pipeline's multimodal position ids (text row, then T/H/W, channels first) go to the model as they
    are and give exactly what upstream computes from its own get_rope_index ids."""
    from runtime.data.vision.packing import pack_multimodal_row
    from runtime.data.vision.tokenization import MultimodalSample, mrope_position_ids

    upstream, generated = vlm_models(model_type)
    batch = vlm_batch(model_type)
    fn = type(generated).get_position_id_func(generated.config)
    ids, types = batch["input_ids"][0], batch["mm_token_type_ids"][0]
    positions = mrope_position_ids(fn, ids, types, image_grid_thw=batch["image_grid_thw"])
    sample = MultimodalSample(
        ids, batch["labels"][0], types, positions, batch["pixel_values"], batch["image_grid_thw"]
    )
    row = pack_multimodal_row([sample], 1000)
    reference, _ = upstream.model.get_rope_index(ids[None], types[None], batch["image_grid_thw"])
    assert row["position_ids"].shape == (4, 1, ids.numel())
    assert torch.equal(row["position_ids"][1:], reference)
    own = upstream(**batch)  # upstream computing its position ids itself
    ref, got = upstream(**row), generated(**row)
    for out in (ref, got):
        assert torch.equal(own.logits, out.logits)
        assert torch.equal(own.loss, out.loss)


@pytest.mark.parametrize("model_type", VLMS)
def test_vlm_with_video_bitwise_equal_to_upstream(model_type: str) -> None:
    """An image and a 3-frame-group video in one sample (qwen3_vl: timestamped frames, the joint image+video
    deepstack path): logits, loss and every gradient bitwise equal to upstream."""
    upstream, generated = vlm_models(model_type)
    batch = vlm_batch(model_type, grids=((1, 2, 4),), text=(4, 3, 6), videos=((3, 2, 2),))
    assert batch["pixel_values_videos"].shape[0] == 12
    kwargs = {"output_router_logits": True} if lookup(model_type).is_moe else {}
    outputs = [m(**batch, **kwargs) for m in (upstream, generated)]
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    for out in outputs:
        out.loss.backward()
    ref, got = grads(upstream), grads(generated)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
