"""A DiT whose forward joins text and image tokens itself before its main blocks (Lumina2): its RoPE module returns
several tables at once (`(hidden_states, cap_rope, img_rope, rope, ...) = self.rope_embedder(...)`), refiner loops
run on each stream apart, then the forward builds the joint sequence (`hidden_states = joint_hidden_states`) and a
key mask of its length, and the main blocks loop over it. The split goes right before that loop: the joint tokens,
the per-token tensors created of their (batch, length) and the one table the main blocks take. None where the
forward is not laid out so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

from patchgen.draft.dit_layout import assign_of
from patchgen.draft.dit_rope_tables import position_rotary_dim
from patchgen.draft.structure import Module, dotted, nodes

CREATE = ("new_zeros", "new_ones", "new_full")  # `x.new_zeros(batch, length, ...)`: a tensor of a given layout


@dataclass(frozen=True)
class Joint:
    rope: int  # index of the RoPE statement in the forward's body
    call: cst.Call  # the RoPE call
    rotary: str  # the table the main blocks take
    dim: int  # its token dim
    split: int  # the statement after which the joint tokens are split
    tokens: list[str]  # per-token tensors the main blocks take besides hidden_states (the key mask)


def _tuple_rope(mod: Module, cls: str, body: list[cst.CSTNode], rotary: Callable[[str], bool]) -> int | None:
    """The index of the one `(a, b, ...) = self.<rope>(...)` statement whose module is a RoPE module."""
    built = dict(mod.built(cls))
    found = []
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
            assign = stmt.body[0]
            attr = (dotted(assign.value.func) or "") if isinstance(assign.value, cst.Call) else ""
            if isinstance(assign.targets[0].target, cst.Tuple) and attr.startswith("self."):
                if rotary(built.get(attr[5:], "")):
                    found.append(i)
    return found[0] if len(found) == 1 else None


def _created(body: list[cst.CSTNode], name: str) -> list[str] | None:
    """The first two positional arguments of `name = x.new_zeros(a, b, ...)` in the body (its batch and length)."""
    value = next((v for s in body if (a := assign_of(s))[0] == name and (v := a[1]) is not None), None)
    if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in CREATE):
        return None
    args = [dotted(a.value) for a in value.args if a.keyword is None][:2]
    return args if len(args) == 2 and None not in args else None  # type: ignore[return-value]


def _passed(call: cst.Call) -> list[str]:
    """The names a block call passes positionally (`mask if use_mask else None` passes `mask`)."""
    out = []
    for arg in call.args:
        value = arg.value.body if isinstance(arg.value, cst.IfExp) else arg.value
        if arg.keyword is None and isinstance(value, cst.Name):
            out.append(value.value)
    return out


def joint_sequence(mod: Module, cls: str, body: list[cst.CSTNode], rotary: Callable[[str], bool]) -> Joint | None:
    """The joint layout above, read from the forward's top-level statements."""
    r = _tuple_rope(mod, cls, body, rotary)
    loops = [i for i, s in enumerate(body) if isinstance(s, cst.For) and (dotted(s.iter) or "").startswith("self.")]
    if r is None or not loops:
        return None
    main = body[loops[-1]]
    calls = nodes(main.body, lambda n: isinstance(n, cst.Call) and dotted(n.func) == dotted(main.target))
    passed = _passed(calls[0]) if len(calls) == 1 else []
    stmt = body[r].body[0]
    targets = [dotted(e.value) for e in stmt.targets[0].target.elements]
    tables = [n for n in passed if n in targets and n != "hidden_states"]
    split = max((i for i in range(r, loops[-1]) if assign_of(body[i])[0] == "hidden_states"), default=None)
    if len(tables) != 1 or split is None or "hidden_states" not in passed:
        return None
    joined = _created(body, dotted(assign_of(body[split])[1]) or "")
    tokens = [n for n in passed if n != "hidden_states" and joined and _created(body[:split], n) == joined]
    rope_cls = dict(mod.built(cls)).get(dotted(stmt.value.func)[5:], "")
    dim = position_rotary_dim(mod, rope_cls, targets.index(tables[0]))
    if dim is None or joined is None:
        return None
    return Joint(r, stmt.value, tables[0], dim, split, tokens)
