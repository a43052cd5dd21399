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

__all__ = ["MOVED", "census", "layer_key", "minimal_mixers", "mixing_modules"]

MOVED = 1e-3  # relative change of the other positions that counts as mixing (module docstring)
MIN_TOKENS = 4  # a (batch, n, width) argument with fewer rows is not taken for a token stream


TOKENS, GRID, ROWS = "tokens", "grid", "rows"  # how an argument holds its positions (``_sequence_inputs``)


def _sequence_inputs(args: tuple, kwargs: dict, length: int | None) -> list[tuple[str | int, torch.Tensor, str]]:
    """The floating tensor arguments a module reads positions from, each with its layout: (batch, length, ...)
    tensors (``TOKENS``); ``length`` None: every (batch, n, width) token stream with n >= ``MIN_TOKENS`` (a DiT's
    image, text and joint streams), every channels-first grid (batch, channels, [frames,] height, width) (``GRID``:
    a convolution over the latent image, e.g. a DiT feed-forward's depthwise conv) and every (n, width) stream of
    packed rows without a batch dimension (``ROWS``: a vision tower's patches)."""
    found = []
    for key, value in [*enumerate(args), *kwargs.items()]:
        if not (torch.is_tensor(value) and value.is_floating_point() and value.dim() >= 2):
            continue
        if length is not None:
            if value.dim() >= 3 and value.shape[1] == length:
                found.append((key, value, TOKENS))
        elif value.dim() == 3 and value.shape[1] >= MIN_TOKENS:
            found.append((key, value, TOKENS))
        elif value.dim() in (4, 5) and all(size >= 2 for size in value.shape[2:]):
            found.append((key, value, GRID))
        elif value.dim() == 2 and value.shape[0] >= MIN_TOKENS:
            found.append((key, value, ROWS))
    return found


def _first_tensor(output: Any) -> torch.Tensor | None:
    if torch.is_tensor(output):
        return output
    if isinstance(output, tuple | list):
        return next((o for o in output if torch.is_tensor(o)), None)
    if hasattr(output, "to_tuple"):  # a transformers ModelOutput
        return _first_tensor(output.to_tuple())
    return None


def _first(tensor: torch.Tensor, layout: str) -> tuple:
    """The index of the first position (the one moved)."""
    return {TOKENS: (slice(None), 0), GRID: (slice(None), slice(None), *([0] * (tensor.dim() - 2))), ROWS: (0,)}[
        layout
    ]


def _others(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The positions that share nothing with the moved first one: tokens (rows) 1..; on a grid, the positions whose
    every spatial index is past 0 (a norm over a trailing dim of a (batch, tokens, heads, width) tensor, read as a
    grid, moves only positions in the first one's line: not mixing)."""
    if layout == GRID:
        return tensor[(slice(None), slice(None), *([slice(1, None)] * (tensor.dim() - 2)))]
    return tensor[:, 1:] if layout == TOKENS else tensor[1:]


def _positions(tensor: torch.Tensor, layout: str) -> tuple[int, ...]:
    return {TOKENS: tensor.shape[:2], GRID: (tensor.shape[0], *tensor.shape[2:]), ROWS: tensor.shape[:1]}[layout]


def _moves_others(
    module: nn.Module, args: tuple, kwargs: dict, key: str | int, hidden: torch.Tensor, layout: str
) -> bool:
    moved = hidden.clone()
    first = _first(hidden, layout)
    moved[first] = moved[first] + 3.0 * hidden.std().clamp_min(1e-3)
    if isinstance(key, int):
        args2, kwargs2 = (*args[:key], moved, *args[key + 1 :]), kwargs
    else:
        args2, kwargs2 = args, {**kwargs, key: moved}
    before, after = _first_tensor(module(*args, **kwargs)), _first_tensor(module(*args2, **kwargs2))
    if before is None or after is None or before.dim() != hidden.dim():
        return False  # no per-position output to compare (a router's flattened logits, a pooled vector)
    if _positions(before, layout) != _positions(hidden, layout):
        return False  # positions changed (a strided patch embedding, a merger): no position-for-position comparison
    others, others_after = _others(before, layout).double(), _others(after, layout).double()
    scale = others.norm().clamp_min(1e-30)
    return ((others_after - others).norm() / scale).item() > MOVED


def mixing_modules(model: nn.Module, run: Callable[[], Any], length: int | None = None) -> dict[str, nn.Module]:
    """The modules of ``model`` that mix across the sequence in the forward ``run()`` performs, where the sequence
    dimension is dim 1 of length ``length`` (None: of every token stream, ``_sequence_inputs``), by path; a module
    containing one already found is not tried (it mixes through it, and is not minimal)."""
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
        for name, module, args, kwargs in calls:  # children finish (and are recorded) before their parents
            if name in found or any(_below(other, name) for other in found):
                continue  # a container of a mixer is not minimal: not run again (the whole model is the costliest)
            if any(_moves_others(module, args, kwargs, *seq) for seq in _sequence_inputs(args, kwargs, length)):
                found[name] = module
    return found


def minimal_mixers(found: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The mixers none of whose descendants mixes (module docstring)."""
    return {name: module for name, module in found.items() if not any(_below(other, name) for other in found)}


def _below(other: str, name: str) -> bool:
    """``other`` is a strict descendant of ``name`` (the root's path is "")."""
    return other != name and (name == "" or other.startswith(f"{name}."))


def layer_key(caller: nn.Module, attribute: str) -> str:
    """How the census and the site check name a torch layer: its caller's class and the attribute holding it."""
    return f"{type(caller).__name__}.{attribute}"


def census(
    model: nn.Module, run: Callable[[], Any], length: int | None = None, exempt: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The minimal mixers of ``model`` in ``run()`` (those under an ``exempt`` path left out) as the run-time site
    check watches them (``runtime/parallel/sites.py``): a module of the model's own code by its class name; a torch
    layer by its caller's class and attribute name (``GLUMBConv.conv_depth``: every ``Conv2d`` would include a patch
    embedding that runs before the token split)."""
    keys = set()
    for name, module in minimal_mixers(mixing_modules(model, run, length)).items():
        if any(name == path or name.startswith(f"{path}.") for path in exempt):
            continue
        if type(module).__module__.startswith("torch.") and "." in name:
            parent, _, attribute = name.rpartition(".")
            keys.add(layer_key(model.get_submodule(parent), attribute))
        else:
            keys.add(type(module).__name__)
    return tuple(sorted(keys))
