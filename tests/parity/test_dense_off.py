"""Generated dense LMs with parallelism off are bitwise equal to upstream: logits, loss, every gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.models.registry import lookup, model_types, variant_cases, variant_overrides
from tests.parity.dense import grads, models, packed_batch
from tests.tolerance import assert_within_rounding


# every dense and MoE causal LM on its tiny config and each tiny variant (the config-gated branches they reach)
@pytest.mark.parametrize(("model_type", "variant"), variant_cases(model_types("causal_lm")))
@pytest.mark.parametrize("packed", [False, True])
def test_bitwise_equal_to_upstream(model_type: str, variant: str | None, packed: bool) -> None:
    upstream, generated = models(model_type, **variant_overrides(model_type, variant))
    assert type(generated).__module__ == lookup(model_type).module
    if packed:
        batch = packed_batch((7, 10, 4))
    else:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(1, 97, (2, 13), generator=g)
        batch = {"input_ids": ids, "labels": ids}
    outputs = [m(**batch) for m in (upstream, generated)]
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    for out in outputs:
        out.loss.backward()
    ref, got = grads(upstream), grads(generated)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.mark.parametrize("model_type", model_types("causal_lm", without="moe"))
def test_chunked_loss_matches_upstream_without_logits(model_type: str) -> None:
    """The chunked loss sums in another order than upstream's full one: within the rounding model
    (``tests.tolerance``), upstream's float64 run the truth."""
    upstream, generated = models(model_type)
    truth_model = copy.deepcopy(upstream).double()
    batch = packed_batch((7, 10, 4))
    ref = upstream(**batch)
    got = generated(**batch, loss_chunk_size=5)
    assert got.logits is None  # full-vocabulary logits were never built
    truth = truth_model(**batch)
    for out in (ref, got, truth):
        out.loss.backward()
    results = [{"loss": out.loss.detach(), "grads": grads(m)} for out, m in ((got, generated), (ref, upstream))]
    assert_within_rounding(*results, {"loss": truth.loss.detach(), "grads": grads(truth_model)}, what=model_type)


def test_a_frozen_parameter_is_left_out_and_the_rest_compared() -> None:
    """A parameter with no gradient by design (``requires_grad`` False, as a model may register one): the suites'
    gradient helper compares what exists (it read every parameter's ``.grad`` and failed on the frozen one's None),
    and a trainable parameter the backward did not reach counts as zeros on both sides."""
    upstream, generated = models("qwen3")
    for model in (upstream, generated):
        model.model.norm.weight.requires_grad_(False)
    batch = packed_batch((7, 10, 4))
    for model in (upstream, generated):
        model(**batch).loss.backward()
    ref, got = grads(upstream), grads(generated)
    assert "model.norm.weight" not in ref and ref.keys() == got.keys() and len(ref) > 10
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
