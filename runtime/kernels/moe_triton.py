"""A Triton grouped GEMM for MoE experts over expert-sorted rows (CUDA only; ``import triton`` happens lazily).

Layout: the rows of ``x`` (S, K) are sorted by expert; ``counts`` (E,) says how many rows each expert owns, so
expert ``e`` owns rows ``[starts[e], starts[e] + counts[e])``. Three kernel launches cover forward and backward of
``y[block e] = x[block e] @ weight[e].T`` with ``weight`` (E, N, K):

* forward ``y = x @ W[e]^T`` and input-gradient ``dx = dy @ W[e]`` are the same *grouped* kernel
  (``_grouped_mm_kernel``) with the weight's strides swapped: each program computes one ``BLOCK_M x BLOCK_N`` tile
  of one expert's rows. The tile -> (expert, first row) table is built on the device from ``counts`` (cumsum +
  searchsorted over an upper bound of ``cdiv(S, BLOCK_M) + E`` tiles), so there is no host sync; surplus programs
  return at once.
* weight-gradient ``dW[e] = dy[block e]^T @ x[block e]`` is ``_grouped_wgrad_kernel``: one program per
  ``(expert, BLOCK_N, BLOCK_K)`` tile, reducing over that expert's rows; experts without rows write zeros.

fp32 inputs use ``input_precision="ieee"`` (no TF32), so results match the eager reference to fp32 rounding;
bf16/fp16 accumulate in fp32. Other dtypes (fp64, fp8) are refused: ``tl.dot`` has no fp32-accumulated path for
them here, and the interpreter silently returned garbage for fp64.

The kernels also run under ``TRITON_INTERPRET=1`` (the Triton interpreter, CPU tensors): that is how the test suite
checks them (``tests/gpu_readiness/test_triton_moe.py``). The interpreter's ``tl.dot`` multiplies bf16 tiles as
their raw uint16 storage (triton 3.9), so when interpreting, bf16 tiles are widened to fp32 before the dot
(``PRECISION="upcast"``; exact, since a bf16 x bf16 product fits in fp32): every load, mask, tile and store still
runs in bf16, only the bf16 ``tl.dot`` instruction itself is left to a GPU (docs/performance.md lists what stays
untested).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["triton_available", "triton_grouped_linear", "triton_unavailable_reason"]

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what tl.dot accumulates in fp32 here


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable_reason(x: Tensor | None = None) -> str | None:
    """Why the Triton path cannot run here (None when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'patchgen[gpu]')"
    device_type = None if x is None else x.device.type
    if _interpreting():
        return None if device_type in (None, "cpu") else "TRITON_INTERPRET=1 runs on CPU tensors only"
    if not torch.cuda.is_available():
        return "no CUDA device (the Triton kernels need one; TRITON_INTERPRET=1 runs them on CPU for checking)"
    if device_type not in (None, "cuda"):
        return f"tensors are on {device_type}, the Triton kernels need CUDA tensors"
    return None


def triton_available(x: Tensor | None = None) -> bool:
    return triton_unavailable_reason(x) is None


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    # a module global, not a closure: the interpreter finds a kernel's callees in the module's globals only
    global _tile_dot

    @triton.jit
    def _tile_dot(a, b, acc, PRECISION: tl.constexpr):
        """``acc + a @ b`` accumulated in fp32: both kernels' dot (``PRECISION`` as ``_launch_constants`` sets it)."""
        if PRECISION == "upcast":
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if PRECISION == "tensor_core":
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        return acc

    # Both kernels' parameters a line per role (tensors and tables; sizes and strides; the ``_launch_constants``),
    # as Triton kernels are written, not a name per line.
    @triton.jit
    def _grouped_mm_kernel(
        a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
        N, K, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # c[rows of expert e, n] = sum_k a[row, k] * b[e, k, n]  (b addressed through its strides)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert >= 0:
            row_start = tl.load(tile_row_ptr + pid_m)
            row_end = tl.load(ends_ptr + expert)
            rows = row_start + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            row_ok = rows < row_end
            col_ok = cols < N
            a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
            b_base = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + ks) < K
                a = tl.load(a_rows + (k0 + ks)[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_base + (k0 + ks)[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = _tile_dot(a, b, acc, PRECISION)
            c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_wgrad_kernel(
        g_ptr, x_ptr, w_ptr, starts_ptr, ends_ptr,
        N, K, stride_gm, stride_gn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # w[e, n, k] = sum over rows r of expert e: g[r, n] * x[r, k]
        expert = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        row_start = tl.load(starts_ptr + expert)
        row_end = tl.load(ends_ptr + expert)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        ms = tl.arange(0, BLOCK_M)
        n_ok = ns < N
        k_ok = ks < K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in range(row_start, row_end, BLOCK_M):
            rows = m0 + ms
            row_ok = rows < row_end
            rows64 = rows.to(tl.int64)
            g_t = tl.load(
                g_ptr + rows64[None, :] * stride_gm + ns[:, None] * stride_gn,
                mask=n_ok[:, None] & row_ok[None, :],
                other=0.0,
            )
            x = tl.load(
                x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = _tile_dot(g_t, x, acc, PRECISION)
        w = w_ptr + expert.to(tl.int64) * stride_we + ns[:, None] * stride_wn + ks[None, :] * stride_wk
        tl.store(w, acc.to(w_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])

    return _grouped_mm_kernel, _grouped_wgrad_kernel


def _launch_constants(dtype: torch.dtype) -> dict[str, Any]:
    """Both kernels' constexprs: the block sizes and ``PRECISION`` of their dot: "ieee" for fp32 (products without
    TF32), "upcast" for bf16 under the interpreter (tiles widened to fp32 for its tl.dot, see above; IEEE), else
    "tensor_core" (bf16/fp16 MMA, fp32 accumulation)."""
    if dtype == torch.bfloat16 and _interpreting():
        precision = "upcast"
    else:
        precision = "ieee" if dtype == torch.float32 else "tensor_core"
    return {"PRECISION": precision, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_table(counts: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Per-expert row ranges and the tile -> (expert, first row) table, all on the device (no host sync)."""
    counts = counts.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    tiles = torch.div(counts + BLOCK_M - 1, BLOCK_M, rounding_mode="floor")
    tile_ends = torch.cumsum(tiles, 0)
    num_programs = _cdiv(rows, BLOCK_M) + counts.numel()  # >= sum(ceil(c / BLOCK_M))
    pid = torch.arange(num_programs, device=counts.device)
    expert = torch.searchsorted(tile_ends, pid, right=True)
    valid = expert < counts.numel()
    expert = expert.clamp_max(counts.numel() - 1)
    first_tile = tile_ends[expert] - tiles[expert]
    tile_row = starts[expert] + (pid - first_tile) * BLOCK_M
    tile_expert = torch.where(valid, expert, -1).to(torch.int32)
    return tile_expert, tile_row.to(torch.int32), starts.to(torch.int32), ends.to(torch.int32), num_programs


def _launch_mm(
    a: Tensor, weight: Tensor, table: tuple[Tensor, Tensor, Tensor, Tensor, int], transpose_b: bool
) -> Tensor:
    """``c[block e] = a[block e] @ (weight[e].T if transpose_b else weight[e])`` for ``weight`` (E, N, K)."""
    mm_kernel, _ = _kernels()
    tile_expert, tile_row, _, ends, num_programs = table
    if transpose_b:  # b[e] is (K, N): b[e, k, n] = weight[e, n, k]
        red, out_cols = weight.size(2), weight.size(1)
        stride_bk, stride_bn = weight.stride(2), weight.stride(1)
    else:  # b[e] is (N, K) used as-is: reduce over N
        red, out_cols = weight.size(1), weight.size(2)
        stride_bk, stride_bn = weight.stride(1), weight.stride(2)
    out = a.new_empty(a.size(0), out_cols)
    grid = (num_programs, _cdiv(out_cols, BLOCK_N))
    mm_kernel[grid](
        a,
        weight,
        out,
        tile_expert,
        tile_row,
        ends,
        out_cols,
        red,
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        stride_bk,
        stride_bn,
        out.stride(0),
        out.stride(1),
        **_launch_constants(a.dtype),
    )
    return out


def _launch_wgrad(
    grad: Tensor, x: Tensor, weight: Tensor, table: tuple[Tensor, Tensor, Tensor, Tensor, int]
) -> Tensor:
    _, wgrad_kernel = _kernels()
    _, _, starts, ends, _ = table
    experts, n, k = weight.shape
    out = torch.empty_like(weight, memory_format=torch.contiguous_format)
    grid = (experts, _cdiv(n, BLOCK_N), _cdiv(k, BLOCK_K))
    wgrad_kernel[grid](
        grad,
        x,
        out,
        starts,
        ends,
        n,
        k,
        grad.stride(0),
        grad.stride(1),
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        **_launch_constants(x.dtype),
    )
    return out


class _TritonGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        table = _tile_table(counts, x.size(0))
        ctx.save_for_backward(x, weight)
        ctx.table = table
        return _launch_mm(x, weight, table, transpose_b=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _launch_mm(grad, weight, ctx.table, transpose_b=False) if ctx.needs_input_grad[0] else None
        grad_w = _launch_wgrad(grad, x, weight, ctx.table) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def triton_grouped_linear(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """``y[block e] = x[block e] @ weight[e].T`` with the Triton kernels; same contract as ``grouped_linear``."""
    reason = triton_unavailable_reason(x)
    if reason is not None:
        raise RuntimeError(f"triton_grouped_linear: {reason}")
    if x.dtype != weight.dtype:
        raise ValueError(f"triton_grouped_linear: x is {x.dtype} but weight is {weight.dtype}")
    if x.dtype not in DTYPES:
        raise ValueError(
            f"triton_grouped_linear: {x.dtype} is not supported (the kernels take {', '.join(map(str, DTYPES))}); "
            f"use impl='grouped' for other dtypes"
        )
    if x.size(0) == 0:  # nothing to launch for; an empty contraction still gives the weight a zero gradient
        return torch.einsum("tk,enk->tn", x, weight)
    return _TritonGroupedLinear.apply(x.contiguous(), weight, counts)
