"""One upstream/generated pair per (model, attention implementation), shared by the whole suite (every test sets
the mode and clears the gradients it uses); one intra-op thread (tiny ops: threads cost far more than they give on
a shared 2-core machine, ~100x measured for generate)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from runtime.models.registry import lookup
from tests.fidelity.common import Pair, make_pair


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def pairs() -> Callable[[str, str], Pair]:
    built: dict[tuple[str, str], Pair] = {}

    def get(model_type: str, attn: str | None = None) -> Pair:
        """``attn`` None: the spec's ``[model.data] attn_implementation`` (sdpa by default). An implementation
        transformers refuses for the model (gpt_oss and mimo_v2_flash: ``_supports_sdpa = False``) skips the test,
        saying so: upstream itself cannot run that scenario."""
        entry = lookup(model_type)
        attn = attn or entry.data.get("attn_implementation", "sdpa")
        if attn == "sdpa" and not getattr(entry.model_class(), "_supports_sdpa", True):
            pytest.skip(f"{model_type}: transformers refuses sdpa for it (_supports_sdpa = False); eager covers it")
        if (model_type, attn) not in built:
            built[model_type, attn] = make_pair(model_type, attn)
        return built[model_type, attn]

    return get
