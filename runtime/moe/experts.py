"""Routed MoE experts behind one function, ``experts_forward``, with an eager reference and fast grouped paths.

Weights are stacked like transformers' ``Qwen3MoeExperts``: ``gate_up_proj`` is ``(E, 2I, H)`` (gate rows first,
then up rows) and ``down_proj`` is ``(E, H, I)``; expert ``e`` computes
``down_proj[e] @ (act(gate_up_proj[e][:I] @ x) * gate_up_proj[e][I:] @ x)``, and a token's output is the sum over
its top-k slots of ``routing weight * expert output``.

Implementations (``impl=``):

* ``"eager"`` — the numerical reference: transformers' per-expert loop, op for op, so forward and backward are
  **bitwise** equal to ``Qwen3MoeExperts.forward`` (tested against the real module).
* ``"grouped"`` — every (token, slot) pair is sorted by expert with a stable argsort, so each expert's rows are one
  contiguous block; both projections are grouped matmuls over those blocks (``grouped_linear``), then the rows are
  scaled by their routing weights and scatter-added (``index_add``) back to their tokens. Which grouped matmul runs
  is chosen per call (``backend=None``): the fastest measured on this machine for problems large enough to time
  (``runtime.moe.autotune``), else the fixed rule of ``pick_backend``:

  - ``"torch"``: ``torch._grouped_mm`` — on CUDA for bf16 at SM80+ (the dtype/capability torch documents); on CPU
    (torch >= 2.9 ships a CPU kernel) for fp32/bf16/fp16 when every stride and pointer is 16-byte aligned. The CPU
    kernel's *own* autograd fails on a stride-0 gradient (e.g. the expanded gradient of ``out.sum()``: "Invalid
    strides/sizes"), so ``grouped_linear`` has its own backward that makes the gradient contiguous and computes
    ``dX`` and ``dW`` with two more grouped matmuls.
  - ``"segment"``: a loop of ``torch.mm`` over the contiguous per-expert blocks (no gathers, results written in
    place); the fallback everywhere (fp64, unaligned shapes, fp32 on CUDA).
  - ``"bmm"``: pad every block to the largest one, one ``torch.bmm``; kept for measurements (``bench/moe.py``).

  Measured (``bench/moe.py``: 2 shared CPU cores, fp32, E=64, top-k 8, H=512, I=512, 4096 tokens, forward +
  backward, one thread's user CPU time with freed memory kept, an earlier median-of-5 run; 2026-11-24; the current
  method (fastest of 11 interleaved rounds) and its figures: docs/performance.md): upstream eager 3.5-3.8 s,
  upstream ``grouped_mm`` 1.96-2.08 s, ours ``torch`` 1.82-1.90 s, ``segment`` 1.78-1.97 s, ``bmm`` 2.0-2.2 s.
  ``torch`` and ``segment`` are within noise of each other: each expert gets ~512 rows, so the
  per-expert GEMMs (512 x 512 x 1024) run near MKL's peak either way and most of the step is GEMM time; ``bmm``
  loses because padding every expert to the largest one (556 rows here) costs ~9% more FLOPs plus two full copies
  of the rows. Which one runs is measured, not assumed (``runtime.moe.autotune``).

  The speed-up over the eager reference comes from the backward: in eager, every ``gate_up_proj[expert_idx]`` is
  its own autograd node whose backward materialises a *full-size* (E, 2I, H) zero gradient and adds it (E times
  the whole weight; with glibc returning those buffers to the OS, their page faults made the eager step 8 s), and
  every expert re-gathers its rows with a boolean ``where``; here each weight gradient is written once, per expert
  block, in place. The SiLU gate has a fused autograd function (``_SiluGate``: one saved tensor, no ``cat`` in
  backward; ~15% faster than autograd for that part, and its gradients were bit-identical to autograd's in our
  checks).
* ``"triton"`` — the same sorted layout with a Triton grouped-GEMM kernel (``runtime.kernels.moe_triton``); CUDA
  only, imported lazily (the tests run it on CPU tensors under Triton's interpreter, ``TRITON_INTERPRET=1``).

``expert_offset``: the weights may hold only experts ``[expert_offset, expert_offset + E_local)`` (expert
parallelism); ``top_k_index`` holds global ids and slots routed to other experts contribute nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["IMPLS", "GROUPED_BACKENDS", "experts_forward", "grouped_linear", "pick_backend", "sort_by_expert"]

IMPLS = ("eager", "grouped", "triton")
GROUPED_BACKENDS = ("torch", "segment", "bmm")


def _check_inputs(
    hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"experts_forward: hidden must be (tokens, hidden), got shape {tuple(hidden.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.size(0) != hidden.size(0):
        raise ValueError(
            f"experts_forward: top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
            f"must both be (tokens={hidden.size(0)}, top_k)"
        )
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"experts_forward: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError("experts_forward: gate_up_proj must be (E, 2I, H) and down_proj (E, H, I)")
    experts, two_i, h = gate_up_proj.shape
    if h != hidden.size(1) or two_i % 2 or down_proj.shape != (experts, h, two_i // 2):
        raise ValueError(
            f"experts_forward: gate_up_proj {tuple(gate_up_proj.shape)} must be (E, 2I, H) and down_proj "
            f"{tuple(down_proj.shape)} (E, H, I) with H = hidden size {hidden.size(1)}"
        )


# --- eager reference ------------------------------------------------------------------------------------------------


def _eager(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    expert_offset: int,
) -> Tensor:
    num_experts = gate_up_proj.size(0)
    final_hidden_states = torch.zeros_like(hidden)
    with torch.no_grad():
        top_k_index = top_k_index.long()  # one_hot takes int64 only; a no-op (same tensor) for int64
        local_index = top_k_index - expert_offset if expert_offset else top_k_index
        outside = (local_index < 0) | (local_index >= num_experts)
        num_classes = num_experts
        if bool(outside.any()):
            # Slots owned by other ranks go to one extra class, which the loop skips (transformers' EP sentinel).
            local_index = local_index.masked_fill(outside, num_experts)
            num_classes = num_experts + 1
        expert_mask = F.one_hot(local_index, num_classes=num_classes)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    # The loop body is transformers' Qwen3MoeExperts.forward, statement for statement (bitwise parity).
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden[token_idx]
        gate, up = F.linear(current_state, gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = act_fn(gate) * up
        current_hidden_states = F.linear(current_hidden_states, down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


# --- grouped matmul over sorted rows --------------------------------------------------------------------------------


def sort_by_expert(
    top_k_index: Tensor, num_local_experts: int, expert_offset: int = 0, *, all_local: bool = False
) -> tuple[Tensor, Tensor]:
    """Sort the flattened (token, slot) pairs by local expert, dropping slots of non-local experts.

    Returns ``(order, counts)``: ``order`` (S_local,) indexes ``top_k_index.reshape(-1)`` (so ``order // top_k`` is
    the token), stable, so within an expert the rows keep token order; ``counts`` (E_local,) int64 rows per expert.
    ``all_local``: the caller knows every slot is routed to a local expert (all experts local), so nothing is dropped
    and no host sync is needed for the number of kept slots (otherwise one ``int()`` of a device value).
    """
    flat = top_k_index.reshape(-1).long()
    if expert_offset:
        flat = flat - expert_offset
    # Non-local slots become num_local_experts: they sort to the end and fall out of the counts.
    flat = torch.where((flat >= 0) & (flat < num_local_experts), flat, num_local_experts)
    order = torch.argsort(flat, stable=True)
    # A fixed-size count (bincount's output size depends on the data: a graph break under torch.compile).
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    if all_local:
        return order, counts[:num_local_experts]
    kept = int(flat.numel() - counts[num_local_experts])
    return order[:kept], counts[:num_local_experts]


def _aligned(*tensors: Tensor) -> bool:
    """torch._grouped_mm's layout rule: every non-unit stride and every data pointer 16-byte aligned."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if size > 1 and stride != 1 and (stride * t.element_size()) % 16:
                return False
    return True


def pick_backend(x: Tensor, weight: Tensor) -> str:
    """The fixed rule: ``torch`` where ``torch._grouped_mm`` can run the problem, else ``segment``. ``grouped_linear``
    uses it for problems too small to time (``runtime.moe.autotune``), which also asks it whether ``torch`` may run."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return "segment"
    if x.device.type == "cuda":
        ok = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    elif torch.compiler.is_compiling():
        # torch._grouped_mm's fake (meta) kernel takes bf16 only, though the CPU kernel runs fp32/fp16 too: under
        # torch.compile anything else is an error at trace time, not a graph break.
        ok = x.dtype == torch.bfloat16
    elif x.device.type == "cpu":
        ok = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    else:
        ok = False
    # The backward runs grouped matmuls on transposed operands too: every dim must keep 16-byte rows.
    rows_ok = all((n * x.element_size()) % 16 == 0 for n in (x.size(1), weight.size(1)))
    return "torch" if ok and rows_ok and _aligned(x, weight) else "segment"


def _mm_segments(a: Tensor, b: Tensor, counts: list[int], out: Tensor) -> Tensor:
    """``out[block e] = a[block e] @ b[e]`` over the contiguous row blocks given by ``counts``."""
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a[start : start + c], b[e], out=out[start : start + c])
        start += c
    return out


def _wgrad_segments(grad: Tensor, x: Tensor, counts: list[int], out: Tensor) -> Tensor:
    """``out[e] = grad[block e].T @ x[block e]``; zero for experts without rows."""
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(grad[start : start + c].t(), x[start : start + c], out=out[e])
        else:
            out[e].zero_()
        start += c
    return out


def _bmm_padded(a: Tensor, b: Tensor, counts_t: Tensor, counts: list[int]) -> Tensor:
    """Pad every block to the largest one, one bmm, then gather the real rows back."""
    rows = a.size(0)
    if rows == 0:
        return a.new_empty(0, b.size(2))
    capacity = max(counts)
    starts = torch.cumsum(counts_t, 0) - counts_t
    expert = torch.repeat_interleave(torch.arange(len(counts), device=a.device), counts_t, output_size=rows)
    slot = torch.arange(rows, device=a.device) - starts[expert]
    padded = a.new_zeros(len(counts), capacity, a.size(1))
    padded[expert, slot] = a
    return torch.bmm(padded, b)[expert, slot]


def _offsets(counts_t: Tensor) -> Tensor:
    return torch.cumsum(counts_t, 0, dtype=torch.int32)


def _forward_mm(x: Tensor, w_t: Tensor, counts_t: Tensor, counts: list[int] | None, backend: str) -> Tensor:
    """``x[block e] @ w_t[e]`` for ``w_t`` (E, K, N), any layout."""
    if backend == "torch":
        return torch._grouped_mm(x, w_t, offs=_offsets(counts_t))
    assert counts is not None
    if backend == "bmm":
        return _bmm_padded(x, w_t, counts_t, counts)
    return _mm_segments(x, w_t, counts, x.new_empty(x.size(0), w_t.size(2)))


class _GroupedLinear(torch.autograd.Function):
    """``y[block e] = x[block e] @ weight[e].T`` with a hand-written backward (no full-size per-expert grads)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, counts_t: Tensor, counts: list[int] | None, backend: str
    ) -> Tensor:
        ctx.save_for_backward(x, weight, counts_t)
        ctx.counts, ctx.backend = counts, backend
        return _forward_mm(x, weight.transpose(1, 2), counts_t, counts, backend)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        x, weight, counts_t = ctx.saved_tensors
        counts, backend = ctx.counts, ctx.backend
        # Stride-0 (expanded) gradients break torch._grouped_mm and slow every other path down.
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _forward_mm(grad, weight, counts_t, counts, backend)
        if ctx.needs_input_grad[1]:
            if backend == "torch":
                grad_w = torch._grouped_mm(grad.t(), x, offs=_offsets(counts_t))
                # Groups without rows are not written by the kernel. On CPU, find them on the host rather than
                # rewriting the whole gradient with masked_fill (~30 ms per projection at the bench shape).
                empty = counts_t == 0
                if grad_w.device.type == "cpu" and not torch.compiler.is_compiling():  # nonzero: data-dependent
                    grad_w[empty.nonzero()[:, 0]] = 0
                else:
                    grad_w.masked_fill_(empty[:, None, None], 0)
            else:
                assert counts is not None
                grad_w = _wgrad_segments(grad, x, counts, torch.empty_like(weight))
        return grad_x, grad_w, None, None, None


def grouped_linear(x: Tensor, weight: Tensor, counts: Tensor, backend: str | None = None) -> Tensor:
    """``y[block e] = x[block e] @ weight[e].T``: ``x`` (S, K) sorted by expert, ``weight`` (E, N, K), ``counts`` (E,).

    ``counts`` are the rows of each expert, in order, summing to S. ``backend`` is one of ``GROUPED_BACKENDS`` or
    None for the fastest measured here (``runtime.moe.autotune.choose_backend``; ``pick_backend`` for small problems).
    Differentiable in ``x`` and ``weight``; experts without rows get a zero gradient.
    """
    if backend is None:
        from runtime.moe.autotune import choose_backend

        backend = choose_backend(x, weight, counts, grouped_linear, pick_backend, GROUPED_BACKENDS)
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"grouped_linear: unknown backend {backend!r}; expected one of {GROUPED_BACKENDS}")
    if backend == "torch" and not hasattr(torch, "_grouped_mm"):
        raise ValueError("grouped_linear: backend 'torch' needs torch._grouped_mm (torch >= 2.8)")
    host_counts = None if backend == "torch" else [int(c) for c in counts.tolist()]
    if x.size(0) == 0:
        # Nothing to multiply; keep the graph so the weight still gets a (zero) gradient.
        return _GroupedLinear.apply(x, weight, counts, [0] * weight.size(0), "segment")
    return _GroupedLinear.apply(x, weight, counts, host_counts, backend)


class _SiluGate(torch.autograd.Function):
    """``silu(gate) * up`` from the ``(S, 2I)`` gate_up output, saving only that input (autograd would also keep
    ``silu(gate)``) and writing both input gradients into one buffer (autograd would ``cat`` them)."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # dynamo refuses out= into a non-contiguous view (a graph break)
            grad_up.copy_(grad * F.silu(gate))
        else:
            torch.mul(grad, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_gate_up


def _is_silu(act_fn: Callable[[Tensor], Tensor]) -> bool:
    """SiLU as models pass it: ``F.silu``, ``nn.SiLU`` or transformers' ``ACT2FN["silu"]`` (SiLUActivation)."""
    if act_fn is F.silu or isinstance(act_fn, torch.nn.SiLU):
        return True
    cls = type(act_fn)
    return cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations"


def _gated(gate_up: Tensor, act_fn: Callable[[Tensor], Tensor]) -> Tensor:
    if _is_silu(act_fn):
        return _SiluGate.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


def _grouped(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    expert_offset: int,
    linear: Callable[..., Tensor],
    all_local: bool = False,
) -> Tensor:
    top_k = top_k_index.size(1)
    with torch.no_grad():
        order, counts = sort_by_expert(top_k_index, gate_up_proj.size(0), expert_offset, all_local=all_local)
        token_idx = torch.div(order, top_k, rounding_mode="floor")
    return experts_from_sorted(
        hidden, order, token_idx, counts, top_k_weights, gate_up_proj, down_proj, act_fn, linear
    )


def experts_from_sorted(
    hidden: Tensor,
    order: Tensor,
    token_idx: Tensor,
    counts: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    linear: Callable[..., Tensor],
) -> Tensor:
    """The grouped experts once the (token, slot) pairs are sorted (``sort_by_expert``): ``order`` indexes the
    flattened slots, ``token_idx`` their tokens, ``counts`` the rows per local expert; ``linear(x, weight, counts)``
    is the grouped matmul. Also what ``runtime.plan`` runs on fake tensors with a balanced routing."""
    current_state = hidden.index_select(0, token_idx)
    current_hidden_states = linear(_gated(linear(current_state, gate_up_proj, counts), act_fn), down_proj, counts)
    weights = top_k_weights.reshape(-1).index_select(0, order)
    current_hidden_states = current_hidden_states * weights[:, None]
    # Rows are in expert order, so every token accumulates its experts in ascending order, as eager does.
    return torch.zeros_like(hidden).index_add(0, token_idx, current_hidden_states.to(hidden.dtype))


def experts_forward(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    impl: str = "eager",
    expert_offset: int = 0,
    *,
    backend: str | None = None,
    num_experts: int | None = None,
) -> Tensor:
    """Routed experts: ``(T, H)`` tokens, ``(T, K)`` global expert ids and weights -> ``(T, H)``.

    ``gate_up_proj`` (E_local, 2I, H) and ``down_proj`` (E_local, H, I) hold experts
    ``[expert_offset, expert_offset + E_local)``; slots routed elsewhere are ignored. ``impl`` is one of ``IMPLS``
    (see the module docstring); ``backend`` forces a grouped-matmul backend for ``impl="grouped"``.
    ``num_experts``: the router's expert count, when known; if these weights hold all of them (``expert_offset`` 0,
    ``E_local == num_experts``), every slot is local and the grouped paths sort without a host sync.
    """
    _check_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    all_local = expert_offset == 0 and num_experts == gate_up_proj.size(0)
    if impl == "eager":
        return _eager(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn, expert_offset)
    if impl == "grouped":

        def linear(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
            return grouped_linear(x, w, counts, backend)

        return _grouped(
            hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn, expert_offset, linear, all_local
        )
    if impl == "triton":
        from runtime.kernels.moe_triton import triton_grouped_linear, triton_unavailable_reason

        reason = triton_unavailable_reason(hidden)
        if reason is not None:
            raise RuntimeError(f"experts_forward(impl='triton'): {reason}")
        return _grouped(
            hidden,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            act_fn,
            expert_offset,
            triton_grouped_linear,
            all_local,
        )
    raise ValueError(f"experts_forward: unknown impl {impl!r}; expected one of {IMPLS}")
