"""Per-frame conditioning a DiT's forward repeats over each frame's tokens (diffusion forcing: SkyReels-V2), and a
(tokens x tokens) mask it builds under a config switch: read from the forward so the split slices the first after
upstream's repeat and refuses the second. The tokens are split anywhere inside a frame, so only the per-token form
(after the repeat) can be sliced with them; SP attention takes key masks only."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import code_of, normalize
from patchgen.draft.dit_layout import assign_of, grid_product, method_call
from patchgen.draft.structure import Module, dotted, nodes

MASK_REASON = "the (tokens x tokens) mask `{name}` ({when}) masks queries too; SP attention takes key masks only"


def _ints(call: cst.Call) -> list[int] | None:
    values = [a.value for a in call.args]
    return [int(v.value) for v in values] if all(isinstance(v, cst.Integer) for v in values) else None


def _repeated(branch: cst.If) -> list[tuple[str, int, int]]:
    """(tensor, token dim, rank) of each `x = x.repeat(...).flatten(a, b)` in the branch: a per-frame tensor viewed
    as `x.view(...)` (its rank), repeated over the frame's grid and flattened into one token dim `a`; a later
    `x = x.transpose(i, j)` moves that dim."""
    out = []
    body = [s for s in branch.body.body if assign_of(s)[0] is not None]
    for i, stmt in enumerate(body):
        name, value = assign_of(stmt)
        flatten = method_call(value, "flatten")
        repeat = method_call(flatten.func.value, "repeat") if flatten is not None else None
        if repeat is None or dotted(repeat.func.value) != name or _ints(flatten) is None or len(flatten.args) != 2:
            continue
        views = [method_call(v, "view") for s in body[:i] if (a := assign_of(s))[0] == name and (v := a[1])]
        if not views or views[-1] is None or dotted(views[-1].func.value) != name:
            continue
        start, end = _ints(flatten)
        dim, rank = start, len(views[-1].args) - (end - start)
        for later in body[i + 1 :]:
            value = assign_of(later)[1]
            kept = method_call(value, "contiguous")  # `x.transpose(1, 2).contiguous()`: the same layout
            moved = method_call(kept.func.value if kept is not None else value, "transpose")
            if assign_of(later)[0] == name and moved is not None and dotted(moved.func.value) == name:
                pair = _ints(moved) or []
                dim = {pair[0]: pair[1], pair[1]: pair[0]}.get(dim, dim) if len(pair) == 2 else dim
        out.append((name, dim, rank))
    return out


def per_frame(mod: Module, body: list[cst.CSTNode]) -> list[tuple[dict, str, str]]:
    """(vars of dit/shard_per_token, its `before` anchor, note) per tensor the forward repeats from per-frame to
    per-token form in an `if` branch, placed before the statement that runs the blocks."""
    out = []
    for i, branch in enumerate(body):
        if not isinstance(branch, cst.If):
            continue
        found = _repeated(branch)
        runs = next((s for s in body[i + 1 :] if _runs_blocks(s)), None)
        if not found or not isinstance(runs, cst.If):
            continue
        anchor = f"if {normalize(code_of(runs.test).strip(), 'eval')}:"
        for name, dim, rank in found:
            tvars: dict = {"tensor": name, "when": f"{name}.ndim == {rank}"}
            if dim != 1:
                tvars["dim"] = dim
            note = f"`{name}` repeated per frame over the frame's tokens at {mod.where(branch)}"
            out.append((tvars, anchor, note))
    return out


def _runs_blocks(stmt: cst.CSTNode) -> bool:
    """A statement holding the loop `for block in self.<...blocks>`."""
    loops = nodes(stmt, lambda n: isinstance(n, cst.For))
    return any((dotted(loop.iter) or "").startswith("self.") and "blocks" in dotted(loop.iter) for loop in loops)


def token_masks(mod: Module, body: list[cst.CSTNode]) -> list[tuple[str, str, str]]:
    """(when, reason, note) per (tokens x tokens) mask the forward builds under `if self.config.<...>:` (a `reshape` of
    two grid products), which no key-mask split serves."""
    out = []
    for branch in body:
        if not isinstance(branch, cst.If) or "self.config." not in code_of(branch.test):
            continue
        for stmt in branch.body.body:
            name, value = assign_of(stmt)
            reshape = method_call(value, "reshape")
            if reshape is None or len(reshape.args) != 2 or not all(grid_product(a.value) for a in reshape.args):
                continue
            when = normalize(code_of(branch.test).strip(), "eval")
            reason = MASK_REASON.format(name=name, when=when.removeprefix("self.config."))
            out.append((when, reason, f"`{name}` of (tokens x tokens) built under `{when}` at {mod.where(stmt)}"))
    return out
