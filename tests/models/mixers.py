"""Which modules of a model mix information across the sequence, found by behaviour, not by name.

A module *mixes* when a change to one token of its sequence input changes its output at another position. Found by
running the model once with every module's inputs recorded (forward hooks with kwargs), then calling each recorded
module again on the same inputs with the first token of its sequence input moved: its output at the other positions
must stay put for a per-token module (a norm, an MLP, a projection, an expert) and moves for a mixer (attention,
linear attention, a causal convolution, a recurrence). A *minimal* mixer is one none of whose descendants mixes: the
place that needs a sequence-parallel path (its container, a decoder layer, mixes only through it).

The threshold: a per-token module's other positions can move only by rounding (a batched kernel whose blocking
depends on the other rows), i.e. by ~eps32 of their scale; a mixer's move by O(1) of it for an O(1) perturbation.
``MOVED`` = 1e-3 relative sits between the two by orders of magnitude either side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["MOVED", "minimal_mixers", "mixing_modules"]

MOVED = 1e-3  # relative change of the other positions that counts as mixing (module docstring)


def _sequence_input(args: tuple, kwargs: dict, length: int) -> tuple[str | int, torch.Tensor] | None:
    """The first floating tensor argument shaped (batch, length, ...) (where the module reads its tokens)."""
    items = [*enumerate(args), *kwargs.items()]
    for key, value in items:
        if torch.is_tensor(value) and value.is_floating_point() and value.dim() >= 3 and value.shape[1] == length:
            return key, value
    return None


def _first_tensor(output: Any) -> torch.Tensor | None:
    if torch.is_tensor(output):
        return output
    if isinstance(output, tuple | list):
        return next((o for o in output if torch.is_tensor(o)), None)
    if hasattr(output, "to_tuple"):  # a transformers ModelOutput
        return _first_tensor(output.to_tuple())
    return None


def _moves_others(module: nn.Module, args: tuple, kwargs: dict, key: str | int, hidden: torch.Tensor) -> bool:
    moved = hidden.clone()
    moved[:, 0] = moved[:, 0] + 3.0 * hidden.std().clamp_min(1e-3)
    if isinstance(key, int):
        args2, kwargs2 = (*args[:key], moved, *args[key + 1 :]), kwargs
    else:
        args2, kwargs2 = args, {**kwargs, key: moved}
    before, after = _first_tensor(module(*args, **kwargs)), _first_tensor(module(*args2, **kwargs2))
    if before is None or after is None or before.dim() < 2 or before.shape[:2] != hidden.shape[:2]:
        return False  # no per-token output to compare (a router's flattened logits, a pooled vector)
    others, others_after = before[:, 1:].double(), after[:, 1:].double()
    scale = others.norm().clamp_min(1e-30)
    return ((others_after - others).norm() / scale).item() > MOVED


def mixing_modules(model: nn.Module, run: Callable[[], Any], length: int) -> dict[str, nn.Module]:
    """Every module of ``model`` that mixes across the sequence in the forward ``run()`` performs, where the
    sequence dimension is dim 1 of length ``length`` (module docstring), by path."""
    calls: list[tuple[str, nn.Module, tuple, dict]] = []
    hooks = [
        module.register_forward_hook(
            lambda mod, args, kwargs, out, name=name: calls.append((name, mod, args, kwargs)), with_kwargs=True
        )
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    found: dict[str, nn.Module] = {}
    with torch.no_grad():
        for name, module, args, kwargs in calls:
            if name in found:
                continue
            seq = _sequence_input(args, kwargs, length)
            if seq is not None and _moves_others(module, args, kwargs, *seq):
                found[name] = module
    return found


def minimal_mixers(found: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The mixers none of whose descendants mixes (module docstring)."""
    return {name: module for name, module in found.items() if not any(_below(other, name) for other in found)}


def _below(other: str, name: str) -> bool:
    """``other`` is a strict descendant of ``name`` (the root's path is "")."""
    return other != name and (name == "" or other.startswith(f"{name}."))
