"""The token dim of RoPE tables a DiT's forward takes as an input (CogVideoX's pipeline computes them) and a
processor rotates with a shared function: read from that function's broadcast of the tables, the branch of its
`sequence_dim` the call takes (diffusers' `apply_rotary_emb`: `cos = cos[None, None, :, :]` under
`sequence_dim == 2`, so the tables' dim 0 meets the tokens' dim 2)."""

from __future__ import annotations

import libcst as cst

from patchgen.draft.structure import dotted, nodes
from patchgen.draft.upstream_names import Modules, imports

SEQUENCE = "sequence_dim"


def table_token_dim(modules: Modules, module: str, processor: str) -> tuple[int | None, str]:
    """(the tables' token dim, note naming where it was read) for `processor` (defined in `module`), or (None, the
    reason it cannot be read, with file:line)."""
    mod = modules.get(module)
    method = mod.method(processor, "__call__")
    where = mod.where(method or mod.classes[processor])
    params = [p.name.value for p in method.params.params if "rotary" in p.name.value] if method else []
    if len(params) != 1:
        return None, f"{processor}.__call__ ({where}) takes {len(params)} RoPE parameters, not one"
    [carrier] = params
    calls = nodes(
        method,
        lambda n: (
            isinstance(n, cst.Call)
            and len(n.args) > 1
            and dotted(n.args[1].value) == carrier
            and isinstance(n.func, cst.Name)
        ),
    )
    names = {c.func.value for c in calls}
    if len(names) != 1:
        return None, f"{processor}.__call__ ({where}) rotates with {len(names)} functions, not one"
    [name] = names
    lines = nodes(method, lambda n: isinstance(n, cst.SimpleStatementLine))
    origin = imports(lines, module).get(name) or imports(mod.tree.body, module).get(name) or (module, name)
    defined = modules.get(origin[0])
    function = next(
        (s for s in defined.tree.body if isinstance(s, cst.FunctionDef) and s.name.value == origin[1]), None
    )
    if function is None:
        return None, f"{processor}.__call__ ({where}) rotates with {name}, not a function draft finds"
    dim = _broadcast_dim(function, _sequence_dim(calls[0], function))
    at = defined.where(function)
    if dim is None:
        return None, f"{name} ({at}) broadcasts its tables in no way draft reads"
    return dim, f"{processor} rotates with the forward's tables by {name} ({at}): tokens on their dim {dim}"


def _sequence_dim(call: cst.Call, function: cst.FunctionDef) -> int | None:
    """The call's `sequence_dim`, else the function's default."""
    given = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == SEQUENCE), None)
    default = next((p.default for p in function.params.params if p.name.value == SEQUENCE), None)
    value = given if given is not None else default
    return int(value.value) if isinstance(value, cst.Integer) else None


def _broadcast_dim(function: cst.FunctionDef, sequence: int | None) -> int | None:
    """Under `if sequence_dim == <sequence>:`, the table dim a `t = t[None, ..., :, ...]` broadcast puts on dim
    `sequence`: the count of its sliced (not None) places before it."""
    if sequence is None:
        return None
    for branch in nodes(function, lambda n: isinstance(n, cst.If)):
        test = branch.test
        if not (
            isinstance(test, cst.Comparison)
            and dotted(test.left) == SEQUENCE
            and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.Equal)
            and isinstance(test.comparisons[0].comparator, cst.Integer)
            and int(test.comparisons[0].comparator.value) == sequence
        ):
            continue
        dims = set()
        for assign in nodes(branch.body, lambda n: isinstance(n, cst.Assign)):
            value = assign.value
            if not isinstance(value, cst.Subscript) or dotted(value.value) != dotted(assign.targets[0].target):
                continue
            kinds = [
                "slice" if isinstance(e.slice, cst.Slice) else dotted(getattr(e.slice, "value", None))
                for e in value.slice
            ]
            if len(kinds) <= sequence or kinds[sequence] != "slice" or set(kinds) - {"slice", "None"}:
                return None
            dims.add(sum(k == "slice" for k in kinds[:sequence]))
        return dims.pop() if len(dims) == 1 else None
    return None
