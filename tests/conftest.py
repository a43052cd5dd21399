"""Session-wide test setup.

``TRITON_INTERPRET=1`` before anything imports triton: triton decorates its own standard library (``tl.zeros``, ...)
when ``triton.language`` is first imported, so the interpreter must be on by then for the Triton MoE kernels to run
on CPU tensors (``tests/gpu_readiness/test_triton_moe.py``). Spawned test ranks inherit it. ``TRITON_INTERPRET=0``
in the environment keeps the compiled kernels (a CUDA machine: the same tests then run on the GPU).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
