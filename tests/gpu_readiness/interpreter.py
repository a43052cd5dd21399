"""Where the Triton kernel tests run: CPU tensors under Triton's interpreter (``tests/conftest.py`` turns it on),
or a CUDA device when ``TRITON_INTERPRET=0`` on a machine with one."""

from __future__ import annotations

import os

import torch


def kernel_device() -> torch.device:
    """Fails (never skips) when the kernels cannot run: the dev extra pins triton so that `make test` runs them."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        assert torch.cuda.is_available(), "TRITON_INTERPRET=0 needs a CUDA device for the Triton kernels"
        return torch.device("cuda")
    # triton's own jit helpers are decorated at import: imported before TRITON_INTERPRET was set, they cannot run.
    assert isinstance(tl.zeros, InterpretedFunction), (
        f"triton {triton.__version__} was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)"
    )
    return torch.device("cpu")
