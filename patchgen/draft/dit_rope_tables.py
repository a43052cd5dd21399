"""The token dim of the RoPE tables a DiT's RoPE module builds, read from how it builds them where no plan states it:
per-axis tables of flattened grid positions joined along their feature dim (HunyuanVideo: tokens on dim 0), and
tables gathered per position from position ids it creates as (batch, tokens, axes) (Lumina2: tokens on dim 1). None
where the module builds them any other way: the split is then a stated reason, never a guess."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import code_of, normalize
from patchgen.draft.dit_layout import assign_of
from patchgen.draft.structure import Module, dotted, nodes

FLAT = ("reshape(-1)", "flatten()")  # a grid of positions as one row per token


def returned(mod: Module, rope_cls: str) -> list[str] | None:
    """The names the RoPE module's forward returns (a tuple of names or one name), None for any other return."""
    returns = nodes(mod.method(rope_cls, "forward"), lambda n: isinstance(n, cst.Return))
    if len(returns) != 1 or returns[0].value is None:
        return None
    value = returns[0].value
    names = [dotted(e.value) for e in value.elements] if isinstance(value, cst.Tuple) else [dotted(value)]
    return None if None in names else names  # type: ignore[return-value]


def _last_value(forward: cst.FunctionDef, name: str) -> cst.BaseExpression | None:
    values = [v for s in forward.body.body if (a := assign_of(s))[0] == name and (v := a[1]) is not None]
    return values[-1] if values else None


def flat_rotary_dim(mod: Module, rope_cls: str) -> int | None:
    """0 when every table the forward returns is `torch.cat(per_axis, dim=d)` with d > 0 and its rotary function
    gets flattened grid positions (`grid[i].reshape(-1)`): one row per token, the axes joined along the features."""
    forward = mod.method(rope_cls, "forward")
    names = returned(mod, rope_cls) if forward is not None else None
    if not names:
        return None
    rotary = nodes(forward, lambda n: isinstance(n, cst.Call) and "rotary" in (dotted(n.func) or ""))
    flat = any(normalize(code_of(a.value), "eval").endswith(FLAT) for call in rotary for a in call.args)
    for name in names:
        value = _last_value(forward, name)
        if not (isinstance(value, cst.Call) and dotted(value.func) == "torch.cat") or not flat:
            return None
        dims = [a.value for a in value.args[1:] if a.keyword is None or a.keyword.value == "dim"]
        if len(dims) != 1 or not isinstance(dims[0], cst.Integer) or int(dims[0].value) == 0:
            return None
    return 0


def position_rotary_dim(mod: Module, rope_cls: str, index: int) -> int | None:
    """1 when the forward's returned table `index` is computed from position ids it creates as `torch.zeros(batch,
    tokens, axes)` (Lumina2's `freqs_cis = self._get_freqs_cis(position_ids)`): the tables keep the ids' (batch,
    tokens) dims and replace the axes by frequencies."""
    forward = mod.method(rope_cls, "forward")
    names = returned(mod, rope_cls) if forward is not None else None
    if not names or index >= len(names):
        return None
    value = _last_value(forward, names[index])
    if not isinstance(value, cst.Call):
        return None
    for arg in value.args:
        source = _last_value(forward, dotted(arg.value) or "")
        if isinstance(source, cst.Call) and dotted(source.func) == "torch.zeros":
            if sum(a.keyword is None for a in source.args) == 3:
                return 1
    return None
