"""The ATEN_CPU_CAPABILITY values this CPU can run, lowest first: `make test-portability` runs the numerics-sensitive
tests under each, which emulates the kernels (vector widths, hence summation orders) of other CPUs.

Why not just try every value: torch accepts a capability the CPU lacks (it reports AVX512 on an AVX2-only CPU when
asked) and would then die on an illegal instruction, so the ceiling is what torch detects with the variable unset."""

from __future__ import annotations

import os

ORDER = ("default", "avx2", "avx512")


def supported() -> list[str]:
    """``default`` up to the capability torch detects on this CPU (the variable must be unset when torch loads)."""
    if "ATEN_CPU_CAPABILITY" in os.environ:
        raise SystemExit("error: unset ATEN_CPU_CAPABILITY: the ceiling is what torch detects without it")
    import torch

    detected = torch.backends.cpu.get_cpu_capability().lower()
    ceiling = ORDER.index(detected) if detected in ORDER else 0  # an unknown (e.g. non-x86) capability: default only
    return list(ORDER[: ceiling + 1])


if __name__ == "__main__":
    print(" ".join(supported()))
