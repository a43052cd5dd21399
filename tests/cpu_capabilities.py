"""The kernel settings this CPU can run, lowest first, one line each: `make test-portability` runs the
numerics-sensitive tests under each, which emulates the summation orders of other CPUs and their BLAS.

Three libraries choose a CPU's kernels, and with them the order their sums take:

* ATen's own vectorised kernels (reductions, softmax, norms, elementwise): ``ATEN_CPU_CAPABILITY``
  (default | avx2 | avx512);
* MKL's BLAS (every float32 matmul: sgemm and its batched forms): ``MKL_ENABLE_INSTRUCTIONS`` (SSE4_2 | AVX2 |
  AVX512), the most it may use on an Intel CPU, where the AVX-512 sgemm blocks the inner dimension otherwise than
  the AVX2 one; and ``MKL_CBWR`` (conditional numerical reproducibility: COMPATIBLE | AVX2 | AVX512), the code branch
  it must take. On AMD, MKL takes one branch whatever ``MKL_ENABLE_INSTRUCTIONS`` says (measured: bitwise the same
  sgemm), but ``MKL_CBWR=COMPATIBLE`` moves it to the SSE2-compatible branch, which sums in another order;
* oneDNN (convolutions: patch embeddings, VAEs): ``ONEDNN_MAX_CPU_ISA`` (SSE41 | AVX2 | AVX512_CORE).

Each line sets all four to one level: a machine of that level. Why not just try every value: torch accepts a
capability the CPU lacks (it reports AVX512 on an AVX2-only CPU when asked) and would then die on an illegal
instruction, so the ceiling is what torch detects with the variables unset. What this cannot cover: a level above the
CPU's own (an AMD machine without AVX-512 cannot run MKL's AVX-512 path), and MKL's own choices by CPU vendor (it
may take other code paths on AMD and Intel at the same level); the rounding model (runtime/rounding.py), not this
matrix, is what makes the suites hold on those machines."""

from __future__ import annotations

import os

# (ATen capability, MKL's instruction ceiling, MKL's code branch, oneDNN's ISA ceiling), lowest first
LEVELS = (
    ("default", "SSE4_2", "COMPATIBLE", "SSE41"),
    ("avx2", "AVX2", "AVX2", "AVX2"),
    ("avx512", "AVX512", "AVX512", "AVX512_CORE"),
)
VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def supported() -> list[str]:
    """One ``VAR=value ...`` line per level from the lowest up to what torch detects on this CPU (the variables
    must be unset when torch loads)."""
    if set_ := [v for v in VARIABLES if v in os.environ]:
        raise SystemExit(f"error: unset {', '.join(set_)}: the ceiling is what torch detects without them")
    import torch

    detected = torch.backends.cpu.get_cpu_capability().lower()
    names = [level[0] for level in LEVELS]
    ceiling = names.index(detected) if detected in names else 0  # an unknown (e.g. non-x86) capability: default only
    return [" ".join(f"{k}={v}" for k, v in zip(VARIABLES, level, strict=True)) for level in LEVELS[: ceiling + 1]]


if __name__ == "__main__":
    print("\n".join(supported()))
