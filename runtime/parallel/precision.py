"""Mixed precision of a job (``mixed_precision``): bf16 parameters and compute with fp32 gradient reduction, fp32
master weights and fp32 optimizer state, or fp32 throughout.

* More than one rank: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``fsdp_dtypes``,
  passed to ``apply_fsdp``); the sharded fp32 parameters are the master weights the optimizer steps, and a DiT's
  timestep stays fp32 (``runtime/parallel/fsdp.py``).
* One process (no FSDP): the model's forward runs under ``torch.autocast(bf16)`` (``apply_autocast``), as
  accelerate does for ``--mixed_precision bf16``: parameters, gradients and optimizer state stay fp32, matmuls and
  convolutions compute in bf16, and autocast keeps the ops it lists as precision-sensitive (softmax, norms,
  losses) in fp32. The two paths round differently (both are tested against fp32, tests/train/test_mixed_precision.py).

``auto``: bf16 on GPU, fp32 on CPU (where bf16 matmuls are slower than fp32 ones).
"""

from __future__ import annotations

import functools

import torch

from runtime.parallel.state import ParallelState

__all__ = ["MIXED_PRECISION", "apply_autocast", "compute_dtype", "fsdp_dtypes"]

MIXED_PRECISION = ("auto", "bf16", "fp32")


def compute_dtype(mode: str, device_type: str) -> torch.dtype:
    """The dtype forward and backward compute in for ``mixed_precision: mode`` on ``device_type``."""
    if mode not in MIXED_PRECISION:
        raise ValueError(f"mixed precision: expected one of {', '.join(MIXED_PRECISION)}, found {mode!r}")
    if mode == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return torch.bfloat16 if mode == "bf16" else torch.float32


def fsdp_dtypes(mode: str, state: ParallelState) -> dict[str, torch.dtype]:
    """``apply_fsdp``'s ``param_dtype`` and ``reduce_dtype``: gradients are always reduced in fp32."""
    return {"param_dtype": compute_dtype(mode, state.device_type), "reduce_dtype": torch.float32}


def apply_autocast(model: torch.nn.Module, mode: str, state: ParallelState) -> torch.nn.Module:
    """One process: run ``model``'s forward under bf16 autocast when ``mode`` asks for bf16 (else unchanged)."""
    dtype = compute_dtype(mode, state.device_type)
    if state.world_size > 1 or dtype == torch.float32:
        return model
    forward = model.forward

    @functools.wraps(forward)
    def autocast(*args, **kwargs):
        with torch.autocast(state.device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast
    return model
