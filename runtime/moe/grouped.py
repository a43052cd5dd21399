"""The grouped matmul over expert-sorted rows, ``grouped_linear``, and the backends that run it.

Rows sorted by expert (``runtime.moe.sort``) form one contiguous block per expert; ``grouped_linear`` computes
``y[block e] = x[block e] @ weight[e].T`` for every block at once, for both expert projections. Which grouped matmul
runs is chosen per call (``backend=None``): the fastest measured on this machine for problems large enough to time
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
every expert re-gathers its rows with a boolean ``where``; here (``_GroupedLinear``) each weight gradient is written
once, per expert block, in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime import torch_compat

__all__ = ["GROUPED_BACKENDS", "grouped_linear", "pick_backend"]

GROUPED_BACKENDS = ("torch", "segment", "bmm")


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
    if not torch_compat.has_grouped_mm() or x.dtype != weight.dtype:
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
        return torch_compat.grouped_mm(x, w_t, _offsets(counts_t))
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
                grad_w = torch_compat.grouped_mm(grad.t(), x, _offsets(counts_t))
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
    if backend == "torch" and not torch_compat.has_grouped_mm():
        raise ValueError("grouped_linear: backend 'torch' needs torch._grouped_mm (torch >= 2.8)")
    host_counts = None if backend == "torch" else [int(c) for c in counts.tolist()]
    if x.size(0) == 0:
        # Nothing to multiply; keep the graph so the weight still gets a (zero) gradient.
        return _GroupedLinear.apply(x, weight, counts, [0] * weight.size(0), "segment")
    return _GroupedLinear.apply(x, weight, counts, host_counts, backend)
