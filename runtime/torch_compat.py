"""Every torch-version-specific path of the runtime, in one module.

GPU users bring the CUDA torch their cluster has, not this project's CPU pin, so the runtime states a range
(``pyproject.toml``'s ``runtime`` extra) and keeps each private or version-dependent torch API it touches here, behind
one function or name. A torch that lacks one of them is refused in one line naming the version and the API
(:func:`missing_apis`, checked by :func:`require_supported_torch` at job start) instead of failing deep in a step.
docs/libraries.md ("torch versions") records which versions ran where.

What lives here, and why each is version-specific:

* ``torch._grouped_mm`` (private; torch >= 2.8): the MoE experts' grouped GEMM.
* ``aten._scaled_dot_product_efficient_attention`` (CUDA) and ``aten._scaled_dot_product_flash_attention_for_cpu``
  with their backwards: the only SDPA kernels that return the log-sum-exp ring attention merges; their positional
  signatures have changed across releases.
* DTensor's redistribute-plan and sharding-propagation caches (private): emptied when a reused test rank drops its
  process groups.
* ``torch.distributed._composable.checkpoint``: per-block activation checkpointing for modules that are not HF
  ``GradientCheckpointingLayer``.
* ``torch.distributed.checkpoint._traverse.set_element`` and the classes a DCP ``.metadata`` pickle names: the
  weights-only checkpoint reader.
* ``TorchDispatchMode`` / ``FakeTensorMode`` / ``_pytree`` (private modules): the memory planner's fake build and
  peak counter; ``unset_fake_temporarily``, ``FakeTensor`` and ``_DisableTorchDispatch``: its modules run on real
  tensors inside the fake step (``runtime/plan/host_reads.py``).
* ``torch.distributed.utils._apply_to_tensors``: FSDP's own walk of nested inputs, for the fp32 forward inputs.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode  # the planner's allocation counters subclass it

__all__ = ["TorchDispatchMode"]  # with the functions below

# The range of pyproject.toml's `runtime` extra; keep the two equal (tests/test_torch_compat.py reads both).
SUPPORTED_TORCH = ">=2.11,<2.16"

# (module, attribute) of every private torch API below: checked once per job by `require_supported_torch`.
_REQUIRED_APIS = (
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed._composable", "checkpoint"),
    ("torch.distributed.checkpoint._traverse", "set_element"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "FakeTensor"),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    ("torch._C", "_DisableTorchDispatch"),
    ("torch.distributed.utils", "_apply_to_tensors"),
    ("torch.utils._pytree", "tree_leaves"),
)
# aten ops the ring attention calls (by device: the CUDA ones are looked up only where CUDA is available).
_CPU_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
_CUDA_OPS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")


def missing_apis() -> list[str]:
    """The private torch APIs this runtime uses that the installed torch lacks (``module.name``), empty when none."""
    missing = []
    for module, name in _REQUIRED_APIS:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name}")
    ops = _CPU_OPS + (_CUDA_OPS if torch.cuda.is_available() else ())
    missing += [f"torch.ops.aten.{op}" for op in ops if not hasattr(torch.ops.aten, op)]
    return missing


def require_supported_torch() -> None:
    """Refuse, in one line, a torch without an API the runtime calls (a ``RuntimeError`` naming the version)."""
    missing = missing_apis()
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} lacks {', '.join(missing)}, which the runtime calls (supported: torch"
            f"{SUPPORTED_TORCH}, runtime/torch_compat.py); install a torch in that range"
        )


# ------------------------------------------------------------------------------------------------ grouped GEMM
def has_grouped_mm() -> bool:
    """Whether ``torch._grouped_mm`` exists (torch >= 2.8); the MoE kernels fall back to segment GEMMs without it."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: row blocks of ``a`` (ends at ``offs``) times the matching ``b[e]``."""
    return torch._grouped_mm(a, b, offs=offs)


# ------------------------------------------------------------------------------------------------ attention + LSE
def cuda_attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """(out, lse) from the memory-efficient CUDA kernel (takes an additive bias); the LSE's sequence dim is padded
    to a multiple of 32 by the kernel and cut back here."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def cuda_attention_with_lse_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the memory-efficient CUDA kernel given the final ``out`` and ``lse`` (padded back to 32)."""
    empty = torch.empty(0, device=q.device, dtype=torch.int64)
    padded = torch.nn.functional.pad(lse.float(), (0, -lse.shape[-1] % 32))
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, bias, out, padded, empty, empty, 0.0, (True, True, True, False), False, scale=scale
    )
    return grads[0], grads[1], grads[2]


def cpu_attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """(out, lse) from the CPU flash kernel (takes an additive mask)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)


def cpu_attention_with_lse_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the CPU flash kernel given the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


# ------------------------------------------------------------------------------------------------ distributed
def clear_dtensor_caches() -> None:
    """Empty DTensor's redistribute-plan and sharding-propagation caches (both private)."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def composable_checkpoint(module: torch.nn.Module) -> None:
    """Activation-checkpoint ``module`` with the composable API (no wrapper module, so FQNs stay upstream's)."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def set_state_dict_element(state_dict: dict[str, Any], path: Any, value: Any) -> None:
    """DCP's own setter of a (possibly nested) state-dict entry by its object path."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


# (module, name) of the globals a DCP FileSystemWriter's .metadata pickle refers to (torch 2.13), besides dtypes.
DCP_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    }
)


def apply_to_tensors(fn: Any, value: Any) -> Any:
    """FSDP's own walk: ``fn`` applied to every tensor in a nested (dataclass, dict, list, tuple) ``value``."""
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(fn, value)


# ------------------------------------------------------------------------------------------------ fake tensors
def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a pytree (torch's private ``_pytree``, the one that knows torch's own containers)."""
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def tree_map(fn: Any, tree: Any) -> Any:
    """``fn`` applied to every leaf of a pytree, the containers rebuilt (torch's private ``_pytree``)."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` that accepts real inputs: the planner builds and steps a model of any size in it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def real_tensors() -> Any:
    """A context that leaves the active ``FakeTensorMode`` (and yields it; None outside one): ops in it run on real
    tensors, for the planner's modules that read tensor values to the host."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (shapes and dtypes, no values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def no_dispatch() -> Any:
    """A context with Python dispatch off (every dispatch mode and tensor subclass): what is made in it passes no
    mode, so the planner's peak counter does not see it."""
    return torch._C._DisableTorchDispatch()
