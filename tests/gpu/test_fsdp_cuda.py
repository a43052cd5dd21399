"""FSDP2 on NCCL at world size 1 with the GPU's default mixed precision (``MixedPrecisionPolicy``: bf16 parameters
and compute, fp32 gradient reduction; ``runtime.parallel.fsdp.apply_fsdp``) against the same model unsharded in
fp32: the loss and all gradients within the bf16 bounds of docs/performance.md ("bf16 numerics", the same bounds as
tests/gpu_readiness/test_bf16.py), and measurably not fp32 (a policy silently left off would pass any bound)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch

from tests.gpu.common import CUDA, on, rel
from tests.gpu_readiness.test_bf16 import BOUND

pytestmark = pytest.mark.gpu

BACKEND = "nccl"


@pytest.fixture
def world_of_one() -> Iterator[object]:
    """A one-rank process group and the runtime's parallel state on it; both gone afterwards."""
    import torch.distributed as dist

    from runtime.parallel.state import init_parallel_state, set_parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield init_parallel_state(backend=BACKEND)
    finally:
        set_parallel_state(None)
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_fsdp2_bf16_policy_within_bf16_bounds_of_fp32(world_of_one) -> None:
    from torch.distributed.tensor import DTensor

    from runtime.parallel.fsdp import apply_fsdp
    from tests.gpu_readiness.bf16 import _inputs, _model

    state = world_of_one
    assert state.fsdp_mesh is not None and state.world_size == 1
    reference, sharded = _model("dense").to(CUDA), _model("dense").to(CUDA)
    sharded.load_state_dict(reference.state_dict())
    apply_fsdp(sharded, state, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inputs = on(_inputs("dense", 1, 0))
    ref_loss = reference(**inputs).loss.float()
    ref_loss.backward()
    loss = sharded(**inputs).loss.float()
    loss.backward()
    grads = {}
    for name, p in sharded.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert grad.dtype == torch.float32, name  # fp32 master weights and reduction
        grads[name] = grad
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    diff = sum((grads[n].double() - g.double()).norm() ** 2 for n, g in ref_grads.items()) ** 0.5
    total = sum(g.double().norm() ** 2 for g in ref_grads.values()) ** 0.5
    errors = {"loss": rel(loss, ref_loss), "grad": (diff / total).item()}
    print(f"FSDP2 bf16 vs fp32 at world 1 ({BACKEND}): {errors}")
    for key, bound in BOUND.items():
        assert errors[key] < bound, (key, errors)
    assert errors["grad"] > 1e-4  # bf16 really ran
