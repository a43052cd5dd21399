"""ControlNet residuals a DiT's forward adds to its tokens block by block (`hidden_states = hidden_states +
controlnet_block_samples[index_block // interval_control]`): inputs covering every token of the image, which the
token split does not slice, so SP refuses them when given, before the forward's first statement (upstream would add
a whole image's residuals to one rank's slice)."""

from __future__ import annotations

import libcst as cst

from patchgen.draft.dit_layout import canonical
from patchgen.draft.recognised import Found
from patchgen.draft.structure import Module, dotted, nodes

REASON = "ControlNet residuals are whole-image tensors the token split does not slice"
WHY = "ControlNet residuals cover every image token: refuse SP instead of adding them to the wrong tokens"


def residual_refusals(mod: Module, cls: str) -> list[Found]:
    """One `dit/refuse_under_sp` per `*controlnet*` input of `cls.forward` that a loop over a block list indexes
    and adds to the tokens it assigns, in the order of the forward's parameters."""
    forward = mod.method(cls, "forward")
    if forward is None:
        return []
    params = [p.name.value for p in forward.params.params if "controlnet" in p.name.value]
    added: dict[str, cst.CSTNode] = {}
    for loop in nodes(forward, lambda n: isinstance(n, cst.For) and "blocks" in (dotted(_listed(n.iter)) or "")):
        for node in nodes(loop.body, lambda n: isinstance(n, cst.Assign) and len(n.targets) == 1):
            name = _added(node)
            if name in params:
                added.setdefault(name, node)
    body = list(forward.body.body)
    docstring = body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr)
    first = body[1] if docstring and len(body) > 1 else body[0]
    out = []
    for name in (p for p in params if p in added):
        note = f"`{name}` added to the tokens per block at {mod.where(added[name])}"
        tvars = {"when": f"{name} is not None", "reason": REASON}
        out.append(
            Found("dit/refuse_under_sp", f"{cls}.forward", WHY, note, canonical(first), vars=tvars, place="before")
        )
    return out


def _listed(node: cst.BaseExpression) -> cst.BaseExpression:
    """The block list a loop runs over: `self.x` in `enumerate(self.x)` or itself."""
    if isinstance(node, cst.Call) and dotted(node.func) == "enumerate" and node.args:
        return node.args[0].value
    return node


def _added(assign: cst.Assign) -> str | None:
    """`r` of `x = x + r[...]`: an input indexed (per block) and added to the tokens it reassigns."""
    target, value = dotted(assign.targets[0].target), assign.value
    if not isinstance(value, cst.BinaryOperation) or not isinstance(value.operator, cst.Add):
        return None
    if dotted(value.left) != target or not isinstance(value.right, cst.Subscript):
        return None
    return dotted(value.right.value)
