"""Under sequence parallelism a diffusers model's own gradient-checkpointing branch is refused.

Upstream's DiT forwards hold a second path through their blocks: ``if torch.is_grad_enabled() and
self.gradient_checkpointing: self._gradient_checkpointing_func(block, ...)``, with upstream's arguments. A spec
that hands the token split to the blocks as an argument (``dit/pass_split``: Sana, no RoPE to carry it) must patch
that call too; a spec that forgot it would run each rank's blocks on its own tokens only, with every attention site
still passed (the split is simply absent), and train wrong numbers with exit 0 (PixArt-Sigma; Sana's grid-row
feed-forward stops on a reshape error instead). The runtime never takes that branch:
its activation checkpointing is its own per-block checkpoint (``runtime/parallel/fsdp.py``; the DiT blocks are no
``GradientCheckpointingLayer``, so ``model.gradient_checkpointing`` stays False), and one process has no SP. So
while SP is on, a forward pre-hook on the root refuses any training forward with the branch turned on (a
``gradient_checkpointing_enable()`` or diffusers' ``enable_gradient_checkpointing()`` called on the model, before or
after it was sharded), whether or not the spec patched the call: ``parallel.activation_checkpointing`` is the way.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from runtime.config.errors import LayoutRefused
from runtime.parallel.unsharded_class import unsharded_class

__all__ = ["OwnCheckpointingError", "diffusers_models", "own_checkpointing", "refuse_own_checkpointing"]


class OwnCheckpointingError(LayoutRefused):
    """A diffusers model's own gradient-checkpointing branch was turned on under sequence parallelism."""


def diffusers_models(model: nn.Module) -> list[nn.Module]:
    """The diffusers models in ``model`` (itself included). Diffusers' model module is looked up, never imported: a
    process that has not imported it holds no diffusers model, and importing it (about 0.2 s, its quantizers with
    it) for a text model would charge that to the start-up."""
    modeling = sys.modules.get("diffusers.models.modeling_utils")
    if modeling is None:  # no diffusers model was built in this process (or none can be: a text-only install)
        return []
    return [module for module in model.modules() if isinstance(module, modeling.ModelMixin)]


def own_checkpointing(model: nn.Module) -> str | None:
    """The class of the first diffusers model in ``model`` whose own gradient-checkpointing branch is on, or None."""
    return _first_on(diffusers_models(model))


def _first_on(models: list[nn.Module]) -> str | None:
    return next((unsharded_class(m).__name__ for m in models if getattr(m, "gradient_checkpointing", False)), None)


def refuse_own_checkpointing(model: nn.Module, layout: str) -> Any:
    """Install the root pre-hook of the module docstring on ``model`` (``layout``: the SP layout, for the error);
    returns its handle, None where ``model`` holds no diffusers model. The models are found once, here: the
    hook reads one flag per model each training forward."""
    models = diffusers_models(model)
    if not models:
        return None

    def before(root: nn.Module, args: Any) -> None:
        cls = _first_on(models) if root.training and torch.is_grad_enabled() else None
        if cls is not None:
            raise OwnCheckpointingError(
                f"{cls}.gradient_checkpointing is on under {layout}: upstream's checkpointing branch calls the blocks "
                f"with upstream's arguments, which a spec may not hand the token split (each rank would train on its "
                f"own tokens only); checkpoint with parallel.activation_checkpointing: true and leave the model's own "
                f"off (gradient_checkpointing_disable())"
            )

    return model.register_forward_pre_hook(before)
