"""Forward + backward of every generated model with parallelism off is bitwise equal to upstream's: logits, loss
(MoE: the load-balancing loss too) and every parameter's gradient, at batch sizes 1-5 of samples with different
lengths padded left and right with an attention mask, text rows and (vision models) rows with images, a sample
without an image among them; eager and sdpa attention; and with gradient checkpointing on."""

from __future__ import annotations

import pytest

from tests.fidelity.common import ATTENTION, BATCH_SIZES, MODELS, Mismatches, Pair, kinds, ragged_batch

SIDES = ("left", "right")


def _compare(pair: Pair, batch: dict, scenario: str, mismatches: Mismatches) -> None:
    outputs = []
    for model in pair.models:
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(**batch, **pair.forward_kwargs())
        out.loss.backward()
        outputs.append(out)
    for what in ("logits", "loss", "aux_loss"):
        mismatches.check(scenario, what, getattr(outputs[0], what, None), getattr(outputs[1], what, None))
    ref, got = (dict(model.named_parameters()) for model in pair.models)
    if ref.keys() != got.keys():
        mismatches.found.append(f"{scenario}: parameter names differ: {sorted(ref.keys() ^ got.keys())[:5]}")
        return
    for name, param in ref.items():
        mismatches.check(scenario, f"grad {name}", param.grad, got[name].grad)
    trained = [name for name, param in ref.items() if param.grad is not None and bool(param.grad.any())]
    if not trained or (
        "pixel_values" in batch and not any(name.startswith("visual.") or ".visual." in name for name in trained)
    ):
        mismatches.found.append(f"{scenario}: the upstream run trained {len(trained)} parameters (none of the ViT?)")


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("model_type", MODELS)
def test_forward_backward_equals_upstream(model_type: str, attn: str, pairs) -> None:
    pair = pairs(model_type, attn)
    mismatches = Mismatches(model_type)
    for kind in kinds(model_type):
        for batch_size in BATCH_SIZES:
            for side in SIDES:
                batch = ragged_batch(pair, batch_size, side, image=kind == "image", seed=batch_size)
                _compare(pair, batch, f"{attn} {kind} bs={batch_size} {side}", mismatches)
    mismatches.assert_none()


@pytest.mark.parametrize("model_type", MODELS)
def test_gradient_checkpointing_equals_upstream(model_type: str, pairs) -> None:
    """transformers' own checkpointing switch on both models (every GradientCheckpointingLayer: decoder layers and
    ViT blocks recompute in backward)."""
    pair = pairs(model_type)  # the spec's attention (sdpa unless transformers refuses it)
    mismatches = Mismatches(model_type)
    for model in pair.models:
        model.gradient_checkpointing_enable()
    try:
        assert all(model.is_gradient_checkpointing for model in pair.models)
        for kind in kinds(model_type):
            for batch_size in BATCH_SIZES:
                side = SIDES[batch_size % 2]
                batch = ragged_batch(pair, batch_size, side, image=kind == "image", seed=batch_size)
                _compare(pair, batch, f"checkpointing {kind} bs={batch_size} {side}", mismatches)
    finally:
        for model in pair.models:
            model.gradient_checkpointing_disable()
    mismatches.assert_none()
