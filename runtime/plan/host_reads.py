"""Modules whose forward reads tensor values to the host, run on real tensors inside the planner's fake step.

A fake tensor has shapes and no values, so ``.tolist()`` or ``.item()`` on one fails (``aten._local_scalar_dense``).
Some upstream modules turn a tensor into Python numbers and build the rest of the forward from them: Lumina2's
``rope_embedder`` reads the caption lengths from the caption mask (``attention_mask.sum(dim=1).tolist()``) and the
transformer loops over them per sample. :func:`run_on_host` wraps such a module's forward so that it leaves the fake
mode and runs on real tensors:

* every fake tensor an op of the module meets (its inputs, buffers, tensor attributes such as Lumina2's RoPE tables)
  becomes real zeros of the same shape, strides and dtype, one per fake tensor: the plan needs shapes, and the values
  of the latents and tables do not change them;
* the real tensors the step passes stay as they are: the values the module reads must be real, so the plan's input
  builder makes them real (``dit_inputs``: Lumina2's caption mask of ones);
* the outputs come back as fake tensors (``FakeTensorMode.from_tensor``), Python values (the lengths) unchanged, so
  the rest of the step stays fake.

Which modules: ``dit_inputs.HOST_READS``, per model type, next to the inputs that feed them. Only modules off the
autograd graph (their outputs carry no gradient) qualify: one with a trainable parameter or an input that requires
grad is refused, as the plan's backward would miss it.

Memory, as the planner's peak counter (``footprint._LivePeak``, above the fake mode) sees it: the module's real
intermediates count while alive, as they would in training; the zero stand-ins do not (they stand for tensors the
step already holds); the outputs count from the moment they come back, as fresh allocations (a clone in the fake
mode), until the step drops them. Lumina2's at 1024 x 1024: the patchified latents (512 KiB in bf16) and three
complex128 RoPE tables of the caption, image and joint tokens (about 7 MiB together).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from runtime import torch_compat
from runtime.torch_compat import TorchDispatchMode

__all__ = ["run_on_host"]


def run_on_host(model: nn.Module, names: Iterable[str]) -> None:
    """Make each named submodule of ``model`` run on real tensors when called inside a fake mode."""
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(_on_host, module.forward, module, name)


class _RealZeros(TorchDispatchMode):
    """Replaces every fake tensor an op meets by real zeros of its shape, strides and dtype (the same ones each time
    the same fake tensor comes back, so in-place writes persist within the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.stand_ins: dict[int, tuple[Tensor, Tensor]] = {}  # id(fake) -> (fake, kept alive for its id; real)

    def real(self, value: Any) -> Any:
        if not torch_compat.is_fake(value):
            return value
        entry = self.stand_ins.get(id(value))
        if entry is None:
            with torch_compat.no_dispatch():  # not counted: it stands for a tensor the step already holds
                real = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
                entry = self.stand_ins[id(value)] = (value, real.zero_())
        return entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = torch_compat.tree_map(self.real, (args, kwargs or {}))
        return func(*args, **kwargs)


def _on_host(forward: Any, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """``forward`` on real tensors, its tensor outputs returned as fake ones; as is outside a fake mode."""
    with torch_compat.real_tensors() as fake:
        if fake is None:
            return forward(*args, **kwargs)
        graded = [t for t in torch_compat.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.requires_grad]
        if graded or any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"{name}: the plan runs it on real tensors (it reads tensor values to the host), which only works "
                "off the autograd graph; it has a trainable parameter or an input that requires grad"
            )
        zeros = _RealZeros()
        with zeros:
            args, kwargs = torch_compat.tree_map(zeros.real, (args, kwargs))
            out = forward(*args, **kwargs)
        del args, kwargs, zeros
    # back in the fake mode: a clone is an op the peak counter sees, so the outputs count while the step keeps them
    return torch_compat.tree_map(lambda t: fake.from_tensor(t).clone() if isinstance(t, Tensor) else t, out)
