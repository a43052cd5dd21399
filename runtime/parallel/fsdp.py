"""FSDP2 (``fully_shard``) for generated models, activation checkpointing and a DTensor-aware grad-norm clip.

Sharding
--------
``apply_fsdp`` calls ``fully_shard`` on every submodule whose class name is in ``model._no_split_modules`` (the
transformer blocks), bottom-up, then on the root, all on ``state.fsdp_mesh``: parameters are sharded over
``dp_shard x sp`` (dim ``"dp_shard_sp"``) and replicated over ``dp_replicate`` (HSDP when it is > 1: a
reduce-scatter over the shard dim, then an all-reduce over the replicate dim).

Gradient reduction convention: SUM, never average
-------------------------------------------------
The trainer's loss on every rank is that rank's *share* of the global token-weighted mean loss: the sum of that
rank's token losses divided by the token count of the whole global batch (all dp and sp ranks; e.g. HF's loss with
``num_items_in_batch=<global count>``). The global loss is the sum of the shares, so every rank's backward yields a
*partial* gradient and the true gradient is the plain SUM of the partial gradients over every rank of the fsdp mesh
(shard and replicate dims; SP ranks included, matching the SP partial-gradient convention of ``collectives``).
FSDP2 averages by default, so every FSDP module (each block and the root) gets

* ``set_gradient_divide_factor(1.0)``: no division at all (the default divides by the data-parallel size), and
* ``set_force_sum_reduction_for_comms(True)``: the collectives use ``ReduceOp.SUM``. With only the divide factor,
  torch 2.13 would reduce-scatter with ``ReduceOp.PREMUL_SUM(1/1.0)``, which gloo does not implement; forcing SUM
  turns the factor into a post-division by 1.0, which FSDP skips. Result: a pure sum on gloo and NCCL alike.

Note that with SP the *value* of the model's loss is the SP group's share (the SP loss all-reduces the forward over
the SP group) while its gradient is still partial; to log the global loss, sum the loss over ``state.dp_group``.

Activation checkpointing
------------------------
Per block, non-reentrant ``torch.utils.checkpoint``. Blocks that are transformers ``GradientCheckpointingLayer``s
(the generated decoder layers) use that hook: ``gradient_checkpointing = True`` with a non-reentrant checkpoint
function, exactly what ``model.gradient_checkpointing_enable()`` sets, but only on the sharded blocks and without
the embedding ``requires_grad`` hook (non-reentrant checkpointing does not need it). It is active in training mode
only. Other blocks get the composable ``torch.distributed._composable.checkpoint``. Both keep parameter names
unchanged (no wrapper module) and compose with FSDP2, whose hooks skip the all-gather during recomputation
(the pre-backward hook has already unsharded the block). Do not also call ``gradient_checkpointing_enable()``:
the blocks would be recomputed twice (numerically harmless, only slower). Under SP a diffusers model's own
checkpointing branch (``gradient_checkpointing_enable()`` on a DiT) is refused at its first forward: it calls the
blocks with upstream's arguments, which may not carry the token split (``runtime/parallel/own_checkpointing.py``).

Mixed precision
---------------
``param_dtype=torch.bfloat16, reduce_dtype=torch.float32`` (``MixedPrecisionPolicy``): each all-gather casts the
fp32 shards to bf16, forward and backward compute in bf16, gradients are cast to fp32 before their reduce-scatter,
and the sharded parameters the optimizer steps (the master weights) and its state stay fp32. FSDP2 also casts every
floating forward input of a sharded module to bf16 (``cast_forward_inputs``). For the blocks that is wanted, but at
the root it would cast a DiT's ``timestep`` too: t = 937.4 becomes 938 and the high-frequency sinusoids of the
timestep embedding change completely (Wan's gradient error against fp32 grew from 5.4e-3 to 9.2e-2,
docs/performance.md). So the root does not cast; a pre-hook casts its floating inputs except those named in
``FP32_INPUTS`` (``timestep``, ``guidance``), which reach the model in fp32 and are cast by the model where its own
code does (Wan after the sinusoidal projection, as in a bf16 diffusers pipeline).

Clipping
--------
``clip_grad_norm_`` takes the norm over the full (unsharded) gradients: identical on every rank and equal to the
single-process norm. DTensor gradients are reduced over their mesh (shard dims summed, replicate dims not);
plain-tensor gradients are taken as already complete on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Collection, Iterable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from runtime import torch_compat
from runtime.parallel.own_checkpointing import refuse_own_checkpointing
from runtime.parallel.state import ParallelState, get_parallel_state
from runtime.parallel.unsharded_class import unsharded_class

__all__ = [
    "FP32_INPUTS",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "block_modules",
    "clip_grad_norm_",
    "mixed_precision_policy",
]


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules whose class name is in ``model._no_split_modules``, in ``model.modules()`` order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules; cannot tell its blocks")
    # An FSDP-wrapped block's class is a generated subclass named "FSDP<Name>"; match the original name too.
    blocks = [m for m in model.modules() if m is not model and unsharded_class(m).__name__ in names]
    if not blocks:
        raise ValueError(f"no submodule of {type(model).__name__} has a class in _no_split_modules={sorted(names)}")
    return blocks


def apply_activation_checkpointing(model: nn.Module, *, prefer_hf: bool = True) -> nn.Module:
    """Checkpoint every block (see the module docstring); ``prefer_hf=False`` forces the composable checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for block in block_modules(model):
        if prefer_hf and isinstance(block, GradientCheckpointingLayer):
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = checkpoint_fn
        else:
            torch_compat.composable_checkpoint(block)
    return model


# Forward inputs of a bf16 root kept in fp32: per-sample scalars that feed sinusoidal embeddings (module docstring).
FP32_INPUTS = ("timestep", "guidance")


def mixed_precision_policy(
    state: ParallelState, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """``None`` means the device default: bf16 parameters with fp32 reduction on GPU, no casting (fp32) on CPU."""
    on_gpu = state.device_type == "cuda"
    if param_dtype is None and on_gpu:
        param_dtype = torch.bfloat16
    if reduce_dtype is None and on_gpu:
        reduce_dtype = torch.float32
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(
    model: nn.Module,
    state: ParallelState | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    fp32_inputs: Collection[str] = FP32_INPUTS,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 on ``state.fsdp_mesh`` (default: the global state); returns it.

    Gradients are SUMMED over the fsdp mesh (see the module docstring). ``param_dtype`` / ``reduce_dtype``: the
    mixed-precision policy (None: bf16 / fp32 on GPU, no casting on CPU); under a cast, the root's forward inputs
    named in ``fp32_inputs`` stay fp32. Without a mesh (single process) nothing is sharded and no mixed precision
    applies; activation checkpointing still does. Apply before building the optimizer (the parameters become
    DTensors).
    """
    state = get_parallel_state() if state is None else state
    blocks = block_modules(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if state.sp_enabled:  # the runtime checkpoints the blocks itself: upstream's own branch may lose the split
        refuse_own_checkpointing(model, f"parallel.sp = {state.sp_size}")
    if state.fsdp_mesh is None:
        return model
    policy = mixed_precision_policy(state, param_dtype, reduce_dtype)
    kwargs = dict(mesh=state.fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # Expert-parallel experts (DTensors on the ep mesh) shard further over the expert-data-parallel mesh. A wrapper
    # flagged ep_sharded too (peft's LoRA of the experts' weights, runtime/train/lora.py) is sharded in their place,
    # experts and adapter in one unit: gathered before the wrapper's forward reads them, not inside it.
    units: list[str] = []
    for name, module in model.named_modules():
        if getattr(module, "ep_sharded", False) and not any(name.startswith(f"{unit}.") for unit in units):
            units.append(name)
            fully_shard(module, **{**kwargs, "mesh": state.expert_fsdp_mesh})
    for block in reversed(blocks):  # bottom-up, in case a block nests another
        fully_shard(block, **kwargs)
    root = kwargs
    if policy.param_dtype not in (None, torch.float32) and policy.cast_forward_inputs:
        root = {**kwargs, "mp_policy": dataclasses.replace(policy, cast_forward_inputs=False)}
        model.register_forward_pre_hook(_input_cast(model, policy.param_dtype, fp32_inputs), with_kwargs=True)
    fully_shard(model, **root)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _input_cast(model: nn.Module, dtype: torch.dtype, keep: Collection[str]):
    """A forward pre-hook casting the floating inputs of ``model`` to ``dtype``, as FSDP2's ``cast_forward_inputs``
    does, except the arguments named in ``keep`` (positional ones by the forward's signature)."""
    names = list(inspect.signature(model.forward).parameters)
    keep = frozenset(keep)

    def cast(value):
        return value.to(dtype) if isinstance(value, Tensor) and value.is_floating_point() else value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(
            value if i < len(names) and names[i] in keep else torch_compat.apply_to_tensors(cast, value)
            for i, value in enumerate(args)
        )
        kwargs = {k: value if k in keep else torch_compat.apply_to_tensors(cast, value) for k, value in kwargs.items()}
        return args, kwargs

    return hook


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; return the total norm (a plain tensor).

    The norm is over the full gradients, whatever mix of DTensor meshes/placements and plain tensors they are;
    every rank gets the same value. Same scaling rule as ``torch.nn.utils.clip_grad_norm_``.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    # DTensor norms must share a mesh to be stacked; group by layout, reduce each group to a plain tensor.
    groups: dict[object, list[Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total
