"""Generated dense LMs with parallelism off are bitwise equal to upstream: logits, loss, every gradient."""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import lookup, model_types, variant_cases, variant_overrides
from tests.parity.dense import grads, models, packed_batch, relative_error


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
    upstream, generated = models(model_type)
    batch = packed_batch((7, 10, 4))
    ref = upstream(**batch)
    got = generated(**batch, loss_chunk_size=5)
    assert got.logits is None  # full-vocabulary logits were never built
    assert relative_error(got.loss, ref.loss) < 1e-6
    ref.loss.backward()
    got.loss.backward()
    ref_grads, got_grads = grads(upstream), grads(generated)
    for name in ref_grads:
        assert relative_error(got_grads[name], ref_grads[name]) < 1e-5, name
