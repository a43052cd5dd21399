"""Non-finite values stop the run, in every trainer: text, VLM and omni models and DiTs (``run_job``) and Flow-GRPO.

A NaN or inf loss or gradient norm makes AdamW write NaN into every parameter it touches, and the run then trains on
garbage with exit code 0. So after the backward and before ``optimizer.step`` the trainers call ``guard_update``:

* every learning rate the optimizer is about to use must be finite (an ``inf`` lr times a finite gradient gives inf
  parameters while this step's loss and gradient norm are finite; it is caught here, before the step applies it);
* the step's loss and gradient norm must be finite. Whether they are is agreed over all ranks with one all-reduce
  (MAX of two flags), so every rank stops, or skips, at the same step and none is left waiting in a collective;
* a non-finite step either stops the run (``stop``: ``NonFiniteError``, one line naming the step and the samples or
  cache shards the step came from, exit 2 through the trainers' user-error path) or is skipped (``skip``: gradients
  dropped, no ``optimizer.step``, so neither the parameters nor AdamW's moments change; the caller counts it).

Either way no optimizer step applies a non-finite update. Naming the samples costs nothing on good steps: the sources
are only described (and gathered from every rank) once a step has been found non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from runtime.config.errors import ConfigError

NONFINITE_MODES = ("stop", "skip")
SHOWN_SOURCES = 8  # sources named in one message; the rest are counted


class NonFiniteError(ConfigError):
    """A step whose loss, gradient norm or learning rate is not finite; the message names the step and its data."""


def check_mode(mode: str, setting: str) -> None:
    if mode not in NONFINITE_MODES:
        raise ConfigError(f"{setting}: expected one of {', '.join(NONFINITE_MODES)}, found {mode!r}")


def _label(step: int | str) -> str:
    return f"step {step}" if isinstance(step, int) else step


def check_learning_rates(optimizer: torch.optim.Optimizer, step: int | str, setting: str) -> None:
    """Every param group's lr must be finite before ``optimizer.step`` uses it; ``setting`` names where it is set."""
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        if not math.isfinite(lr):
            raise NonFiniteError(
                f"{setting}: the learning rate at {_label(step)} is {lr}, not a finite number; stopped before the "
                f"optimizer step (no parameter was changed by it)"
            )


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def nonfinite_flags(
    loss: torch.Tensor, grad_norm: torch.Tensor | float, group: dist.ProcessGroup | None = None
) -> tuple[bool, bool]:
    """(loss not finite, gradient norm not finite) on any rank of ``group``: one all-reduce, the same on every rank."""
    loss = loss.detach().float().reshape(())
    norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=loss.device).detach().reshape(())
    flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(norm)]).to(torch.float32)
    if _distributed(group):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    bad_loss, bad_norm = flags.tolist()
    return bool(bad_loss), bool(bad_norm)


MicroBatch = tuple[list[str], bool]  # what a micro-batch was made of, and whether its loss was finite


def micro_batches(losses: Sequence[torch.Tensor], sources: Sequence[Sequence[str]]) -> list[MicroBatch]:
    """This rank's micro-batches (``sources[i]``: what micro-batch ``i`` was made of, ``losses[i]`` its loss) with
    whether each loss is finite; all count as finite when the losses are not given one per micro-batch."""
    if len(losses) != len(sources):
        return [(list(names), True) for names in sources]
    return [
        (list(names), bool(torch.isfinite(loss.detach()).all())) for loss, names in zip(losses, sources, strict=True)
    ]


def blame(parts: Sequence[MicroBatch]) -> list[str]:
    """The data to name: the micro-batches whose loss is not finite, or every one when all losses are (then the
    gradient went non-finite, and any of them may be the cause); in order, each name once (SP ranks share rows)."""
    bad = [names for names, finite in parts if not finite]
    chosen = bad or [names for names, _ in parts]
    return list(dict.fromkeys(name for names in chosen for name in names))


def gather_micro_batches(local: Sequence[MicroBatch], group: dist.ProcessGroup | None = None) -> list[MicroBatch]:
    """Every rank's micro-batches, in rank order. Collective."""
    if not _distributed(group):
        return list(local)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, [(list(names), finite) for names, finite in local], group=group)
    return [(names, finite) for part in parts for names, finite in part]


def _named(sources: Sequence[str]) -> str:
    if not sources:
        return "unknown data"
    shown = ", ".join(sources[:SHOWN_SOURCES])
    return shown + (f" and {len(sources) - SHOWN_SOURCES} more" if len(sources) > SHOWN_SOURCES else "")


def guard_update(
    step: int | str,
    loss: torch.Tensor,
    grad_norm: torch.Tensor | float,
    optimizer: torch.optim.Optimizer,
    *,
    mode: str,
    sources: Callable[[], Sequence[MicroBatch]],
    lr_setting: str = "optim.lr",
    mode_setting: str = "train.nonfinite",
    group: dist.ProcessGroup | None = None,
) -> bool:
    """Whether the optimizer may step (``True``), or the step is skipped (``False``, mode ``skip``: its gradients are
    dropped). Raises ``NonFiniteError`` for a non-finite learning rate (whatever the mode: skipping would skip every
    step) and, in mode ``stop``, for a non-finite loss or gradient norm. ``loss`` and ``grad_norm`` are the step's
    global values (or this rank's: the flags are reduced over ``group``); ``sources()`` gives this rank's
    ``micro_batches`` and is called, collectively, only when the step is not finite; ``step`` is the step
    number, or a label (``"iteration 3"``). Collective."""
    check_learning_rates(optimizer, step, lr_setting)
    bad_loss, bad_norm = nonfinite_flags(loss, grad_norm, group)
    if not (bad_loss or bad_norm):
        return True
    if mode == "skip":
        optimizer.zero_grad(set_to_none=True)
        return False
    named = _named(blame(gather_micro_batches(sources(), group)))
    what = {
        (True, False): "the loss is",
        (False, True): "the gradient norm is",
        (True, True): "the loss and the gradient norm are",
    }[(bad_loss, bad_norm)]
    raise NonFiniteError(
        f"{_label(step)}: {what} not finite (NaN or inf) on {named}; stopped before the optimizer step (no parameter "
        f"was changed by it); set {mode_setting}: skip to skip such steps instead"
    )
