"""DiT context parallelism past the head count against one process: loss, output and every parameter gradient within
1e-5 relative (tests/dit/test_sp.py's comparison), gradient checkpointing on.

* ring=2 (world 2): every DiT spec's tiny case, not its variants (self-attention, replicated text first or last, a
  key mask over padded text, no RoPE, (b, h, s, d)): the attention call is ``runtime.sp.ring.ring_attention`` (the
  ``dit/ring_attention`` patch), the image K/V blocks pass around the ring and the replicated text K/V are attended
  once per query as its ``extra_kv``;
* ring=4 and ulysses=2 x ring=2 (world 4): Wan and Flux, plus Wan with 2 heads, where SP=4 is twice the head count.

Every attention call checks that the text stream is bitwise the same on every rank (``_EveryCall``). Every token
count is indivisible by 2 and 4, so the last ring rank's span holds padding keys the ring must hide.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist_utils import run_distributed
from tests.dit.cases import CASES, inputs, loss_and_grads, shell
from tests.dit.test_sp import _compare
from tests.supports import has, require

# one case per DiT spec, and Wan2.2 TI2V's per-token timesteps (sharded with the tokens); a spec whose class lacks a
# ring is left out here and reported by test_every_spec_runs_on_a_ring_or_states_why
RING2 = [
    (name, None)
    for name in sorted(CASES)
    if (CASES[name].variant is None or name == "wan_ti2v") and has(CASES[name].model_type, "ring")
]
# of those, the ones generated here (`upgrade --verify` runs this file in a tree holding only the models it proves)
WORLD4 = [case for case in (("wan", None), ("flux", None), ("wan", 2)) if case[0] in CASES]


class _EveryCall(set):
    """The model's set of layout-checked attention sites, never holding one: under SP every attention call then runs
    ``sp_layout.check_layout``, which fails unless the replicated (text) segment is bitwise equal on every SP rank
    (the ring must leave the text stream replicated, not merely close, for every later block)."""

    def add(self, site: object) -> None:
        pass


def _run(name: str, heads: int | None) -> dict:
    case = CASES[name]
    if heads is not None:
        case = dataclasses.replace(case, config={**case.config, "num_attention_heads": heads})
    model = shell(case)
    model.__dict__["_patchgen_sp_checked_sites"] = _EveryCall()  # read by runtime.diffusion.sp.token_shard
    model.gradient_checkpointing_enable()
    model.train()
    out, loss, grads = loss_and_grads(model, inputs(case))
    return {"out": out, "loss": loss, "grads": grads}


def ring_worker(rank: int, world_size: int, ring: int, cases: list[tuple[str, int | None]]) -> list[dict]:
    import torch.distributed as dist

    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    assert state.ring_size == ring and state.ulysses_size == world_size // ring
    results = []
    for case in cases:
        result = _run(*case)
        for grad in result["grads"].values():  # partial gradients: the SP group's sum is the true gradient
            if grad is not None:
                dist.all_reduce(grad, group=state.sp_group)
        results.append(result)
    return results


@pytest.mark.parametrize("model_type", sorted({case.model_type for case in CASES.values()}))
def test_every_spec_runs_on_a_ring_or_states_why(model_type: str) -> None:
    require(model_type, "ring")


@pytest.mark.dist
def test_ring2_matches_single_process() -> None:
    _compare(run_distributed(ring_worker, 2, 2, RING2, timeout=300), RING2, run=_run)


@pytest.mark.dist
@pytest.mark.parametrize("ring", [4, 2], ids=["ring4", "ulysses2_ring2"])
def test_sp4_past_the_heads_matches_single_process(ring: int) -> None:
    _compare(run_distributed(ring_worker, 4, ring, WORLD4, timeout=300), WORLD4, run=_run)


def test_ring_attention_masks_without_a_ring() -> None:
    """``ring_attention``'s ``kv_valid`` (padding keys) and ``extra_valid`` (padded text keys) on its no-ring path, in
    float64 against softmax(q k^T * scale) v over the joined [text, local] keys with the same mask, written out."""
    import torch

    from runtime.sp.ring import ring_attention

    gen = torch.Generator().manual_seed(0)
    b, h, s, text, d, scale = 2, 3, 6, 4, 8, 0.3

    def rand(length: int) -> torch.Tensor:
        return torch.randn(b, h, length, d, dtype=torch.float64, generator=gen)

    q, k, v, text_k, text_v = rand(text + s), rand(s), rand(s), rand(text), rand(text)
    kv_valid = (torch.arange(s) < 4).view(1, 1, s)  # the last 2 local keys are padding
    text_valid = torch.ones(b, text, dtype=torch.bool)
    text_valid[1, -2:] = False  # the second sample's last 2 text tokens are padding
    out = ring_attention(
        q, k, v, group=None, causal=False, scale=scale, extra_kv=(text_k, text_v), kv_valid=kv_valid,
        extra_valid=text_valid,
    )  # fmt: skip
    seen = torch.cat([text_valid, kv_valid[0].expand(b, s)], 1)[:, None, None, :]
    scores = (q @ torch.cat([text_k, k], 2).transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    expected = scores.softmax(-1) @ torch.cat([text_v, v], 2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
