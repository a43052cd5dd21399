"""One forward+backward of each family's generated tiny model at SP=2, eager and with every block compiled
(``runtime.parallel.compile.apply_compile``) then FSDP2 over the two ranks (``apply_fsdp``, as the trainer), on the
same rank with the same weights and inputs; and what dynamo saw. Eager also runs in float64 (the same weights and
inputs, widened): the rounding model's witness (``tests.tolerance``), since compiling reorders and fuses float32 sums.

Families: dense (qwen3, packed row), MoE with EP (qwen3_moe, grouped experts, ep=2 over the two SP ranks), VLM
(qwen3_vl with two images: ViT, deepstack and LM blocks) and DiT (Wan). Gradients are this rank's (partial) ones;
eager and compiled are compared rank by rank (this rank's shards), which is what compiling changes.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = {"dense": "qwen3", "moe": "qwen3_moe", "vlm": "qwen3_vl", "dit": "wan"}

# What a graph break is, from dynamo's reason text (``counters["graph_break"]``); docs/performance.md names where.
KINDS = {
    "host sync": ("_local_scalar_dense", "Tensor.item()"),  # .item() / .tolist() / int() of a device value
    "data-dependent shape": ("Dynamic shape operator", "Data-dependent branching"),
    "output capturing": ("ContextVar",),  # transformers' OutputRecorder hooks (output_router_logits)
    "FSDP2 hook inside a block": ("function `disable`",),  # a module sharded on its own inside a compiled block
    "out= into a non-contiguous view": ("non-contiguous `out=`",),
}


def kind(reason: str) -> str:
    """The ``KINDS`` entry a graph-break reason belongs to, or the reason itself (an unexpected break)."""
    return next((name for name, marks in KINDS.items() if any(m in reason for m in marks)), " ".join(reason.split()))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            out[name] = grad.detach().clone()
    return out


def _widened(value: Any, dtype: torch.dtype) -> Any:
    """A floating input in ``dtype`` (the float64 witness); integer ids and masks as they are."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _step(family: str, state: Any, compiled: bool, backend: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    from runtime.parallel.compile import apply_compile
    from runtime.parallel.fsdp import apply_fsdp
    from tests.gpu_readiness.bf16 import _inputs, _loss, _model

    model = _model(family).to(dtype)
    if family == "moe":
        from runtime.parallel.expert_parallel import apply_ep

        apply_ep(model, state)
    if compiled:
        apply_compile(model, backend=backend)
    apply_fsdp(model, state)  # FSDP2 over the SP ranks, as the trainer: compiled blocks under its hooks
    inputs = {key: _widened(value, dtype) for key, value in _inputs(family, state.sp_size, state.sp_rank).items()}
    loss = _loss(family, model, inputs)
    loss.backward()
    return {"loss": loss.detach(), "grads": _grads(model)}


def compile_worker(rank: int, world: int, families: list[str], backend: str) -> dict[str, Any]:
    """Per family: eager (float32 and the float64 witness) and compiled results, graph-break reasons and graph
    counts (dynamo's counters)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from runtime.parallel.state import init_parallel_state

    results = {}
    for family in families:
        state = init_parallel_state(sp_size=world, ep_size=world if family == "moe" else 1)
        eager = _step(family, state, compiled=False, backend=backend)
        witness = _step(family, state, compiled=False, backend=backend, dtype=torch.float64)
        torch._dynamo.reset()
        counters.clear()
        compiled = _step(family, state, compiled=True, backend=backend)
        results[family] = {
            "eager": eager,
            "witness": witness,
            "compiled": compiled,
            "breaks": {str(reason): int(count) for reason, count in counters["graph_break"].items()},
            "graphs": int(counters["stats"]["unique_graphs"]),
        }
    return results
