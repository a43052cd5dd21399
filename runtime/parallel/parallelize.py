"""One ``parallelize`` for every job (text/VLM/omni trainer, DiT trainer, RL policy and its reference), composed of
the ``apply_*`` steps, as torchtitan's ``parallelize_*`` functions are.

The order is fixed, because each step needs what the one before it left:

1. ``model.to(device)``: shards and buffers are created on the training device;
2. ``apply_ep`` (``state.ep_enabled``): the planned expert parameters become this rank's experts;
3. ``adapters(model)`` (LoRA, when the job has it): after EP, so the experts' adapters see their sharded weights;
   before compile and FSDP2, which must see the adapter modules;
4. ``apply_compile`` (``plan.compile``): per block, before FSDP2 and checkpointing wrap the blocks;
5. ``apply_fsdp`` with activation checkpointing and the mixed-precision policy when there is more than one rank;
   in one process, activation checkpointing alone (``gradient_checkpointing_enable``);
6. ``apply_autocast``: bf16 in one process is autocast (FSDP2's policy does it on more ranks);
7. ``watch_sites`` (``state.sp_enabled``): every attention module, and every module of a class the self-check's
   census found mixing the sequence (``plan.mixer_classes``), must pass a patched site in each forward
   (``runtime/parallel/sites.py``), or the forward raises instead of mixing this rank's tokens only.

The parallel layout itself (sp, ring, ep, dp_shard, dp_replicate) is the ``ParallelState``; what a job adds is its
``ParallelPlan``, stated once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.parallel.compile import apply_compile
from runtime.parallel.expert_parallel import apply_ep
from runtime.parallel.fsdp import apply_fsdp
from runtime.parallel.precision import apply_autocast, fsdp_dtypes
from runtime.parallel.sites import install_site_checks
from runtime.parallel.state import ParallelState

__all__ = ["ParallelPlan", "parallelize", "watch_sites"]


@dataclass(frozen=True)
class ParallelPlan:
    """What a job asks of ``parallelize`` beyond the layout: ``mixed_precision`` auto | bf16 | fp32
    (``runtime/parallel/precision.py``), per-block activation checkpointing, per-block ``torch.compile``."""

    mixed_precision: str = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    compile_backend: str = "inductor"  # train.compile_backend: runtime/config/common.py's COMPILE_BACKENDS
    # module paths that run on replicated tokens before the token split (the model record's replicated_modules):
    # their attention is upstream's and needs no checked site
    replicated_modules: tuple[str, ...] = ()
    model_name: str = "?"  # the spec the model was generated from, for the site check's error
    # classes of the modules that mix the sequence, found by behaviour on the self-check's shrunk model
    # (runtime/parallel/mixers.py): watched like attention modules whatever their name
    mixer_classes: tuple[str, ...] = ()


def parallelize(
    model: nn.Module,
    state: ParallelState,
    plan: ParallelPlan,
    device: torch.device | None = None,
    adapters: Callable[[nn.Module], Any] | None = None,
) -> nn.Module:
    """``model`` made ready to train under ``state`` and ``plan`` (the steps of the module docstring, in place;
    FSDP2 returns the same module object). Call before the optimizer is built: FSDP2 turns parameters into DTensors.
    ``adapters``: injects trainable adapters (LoRA) between expert parallelism and compile/FSDP2."""
    if device is not None:
        model.to(device)
    apply_ep(model, state)
    if adapters is not None:
        adapters(model)
    if plan.compile:
        apply_compile(model, plan.compile_backend)
    if state.world_size > 1:
        dtypes = fsdp_dtypes(plan.mixed_precision, state)
        model = apply_fsdp(model, state, activation_checkpointing=plan.activation_checkpointing, **dtypes)
    elif plan.activation_checkpointing:
        model.gradient_checkpointing_enable()
    watch_sites(model, state, plan)
    return apply_autocast(model, plan.mixed_precision, state)


def watch_sites(model: nn.Module, state: ParallelState, plan: ParallelPlan) -> None:
    """Step 7 (the module docstring); again after the self-check with its census's classes (a module already watched
    is left as it is)."""
    if state.sp_enabled:
        ring = f", parallel.ring = {state.ring_size}" if state.ring_enabled else ""
        layout = f"parallel.sp = {state.sp_size}{ring}"
        install_site_checks(model, layout, plan.replicated_modules, plan.model_name, plan.mixer_classes)
