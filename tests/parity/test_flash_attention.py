"""flash-attn (varlen through packed position ids) — runs only where flash-attn and a CUDA device exist."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from runtime.models.registry import model_types
from tests.parity.dense import models, packed_batch, relative_error

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None),
    reason="flash-attn needs a CUDA device and the flash-attn package (the `gpu` extra); CI machines have neither",
)


@pytest.mark.parametrize("model_type", model_types("causal_lm", without="moe"))
def test_flash_attention_packed_parity(model_type: str) -> None:
    upstream, generated = models(model_type)
    for m in (upstream, generated):
        m.to("cuda", torch.bfloat16).set_attn_implementation("flash_attention_2")
    batch = {k: v.cuda() for k, v in packed_batch((37, 64, 27)).items()}
    ref, got = upstream(**batch), generated(**batch)
    assert torch.equal(ref.logits, got.logits)
    start = 0
    for n in (37, 64, 27):  # varlen: no attention across packed samples
        alone = generated(input_ids=batch["input_ids"][:, start : start + n]).logits
        assert relative_error(got.logits[:, start : start + n].float(), alone.float()) < 2e-2
        start += n
