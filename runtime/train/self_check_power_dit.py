"""The DiT proof's planted defects (``self_check_power.py`` says why a proof plants them): one per kind of SP site
the generated model has, found by what its modules import from the runtime, not listed per model.

- ``one attention site attends to its rank's tokens only``: ``attention_split`` gives the first attention module
  that carries the split no split (its Ulysses all-to-alls and ring skipped: the site attends to the rank's tokens);
- ``one linear-attention site runs on its rank's tokens only``: ``sp_linear_kv``'s first call runs without the SP
  all-reduce of its key-value sums (Sana's linear self-attention);
- ``one convolution sees no neighbouring tokens``: ``grid_halo_conv2d``'s first convolution runs on the rank's rows
  alone, zero-padded at the shard boundary instead of exchanging halo rows (Sana's GLUMBConv);
- ``positions restart at the shard boundary``: every rank takes the first shard's RoPE tables (``shard_rotary``).

A model that imports none of the site functions has no SP site to plant into: its proof then has no planted SP
defect and its line says so. The doubled replica share is planted by the DiT proof's own loss
(``self_check_dit.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from runtime.parallel.state import ParallelState
from runtime.train.self_check_power import (
    LOCAL_ATTENTION,
    LOCAL_CONVOLUTION,
    LOCAL_LINEAR_ATTENTION,
    LOCAL_POSITIONS,
    Defect,
    FirstSite,
    imported_by,
    planted_swap,
)

__all__ = ["dit_defects"]


def _first_attention_local(correct: Callable[..., Any]) -> Callable[..., Any]:
    first = FirstSite()

    def attention_split(carrier: Any, **kwargs: Any) -> Any:
        split = correct(carrier, **kwargs)
        return None if split is not None and first(kwargs.get("module")) else split

    return attention_split


def _first_linear_kv_local(correct: Callable[..., Any]) -> Callable[..., Any]:
    first = FirstSite()

    def sp_linear_kv(value: torch.Tensor, key: torch.Tensor, shard: Any, module: Any = None) -> torch.Tensor:
        return correct(value, key, None if shard is not None and first(module) else shard, module)

    return sp_linear_kv


def _first_grid_conv_local(correct: Callable[..., Any]) -> Callable[..., Any]:
    first = FirstSite()

    def grid_halo_conv2d(shard: Any, conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        return correct(None if shard is not None and first(conv) else shard, conv, x)

    return grid_halo_conv2d


def _first_shard_rotary(correct: Callable[..., Any]) -> Callable[..., Any]:
    from runtime.diffusion.sp import ShardedRotary

    def shard_rotary(rotary: Any, shard: Any, dim: int, parts: tuple[int, ...] = (0, 1), prefix: int = 0) -> Any:
        real = correct(rotary, shard, dim, parts, prefix)
        if not isinstance(real, ShardedRotary):
            return real
        items = [rotary] if real.single else list(rotary)
        for i in (0,) if real.single else parts:
            table = items[i]
            head, tail = table.narrow(dim, 0, prefix), table.narrow(dim, prefix, shard.local)
            items[i] = torch.cat([head, tail], dim=dim) if prefix else tail
        return dataclasses.replace(real, parts=tuple(items))

    return shard_rotary


def dit_defects(state: ParallelState, model: torch.nn.Module) -> list[Defect]:
    """The planted SP defects of a DiT: one per site function the model's modules import (the module docstring)."""
    from runtime.diffusion import sp, sp_grid

    if not state.sp_enabled:
        return []
    kinds = [
        (LOCAL_ATTENTION, "attention_split", sp.attention_split, _first_attention_local),
        (LOCAL_LINEAR_ATTENTION, "sp_linear_kv", sp_grid.sp_linear_kv, _first_linear_kv_local),
        (LOCAL_CONVOLUTION, "grid_halo_conv2d", sp_grid.grid_halo_conv2d, _first_grid_conv_local),
        (LOCAL_POSITIONS, "shard_rotary", sp.shard_rotary, _first_shard_rotary),
    ]
    return [
        Defect(what, planted_swap(name, correct, make))
        for what, name, correct, make in kinds
        if imported_by(model, name, correct)
    ]
