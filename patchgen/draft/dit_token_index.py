"""Blocks that index tokens by their position in the whole sequence: `__init__` builds them under a config switch
(`if image_condition_type == "token_replace":`, HunyuanVideo's I2V blocks) and their forward slices the tokens at a
count the model's forward passes in (`hidden_states[:, :num_tokens]`). On a rank's slice of the tokens that count
names other tokens, so the split is refused under that switch, right where the forward computes the count."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import normalize
from patchgen.draft.dit_layout import assign_of, canonical
from patchgen.draft.structure import Module, dotted, nodes

REASON = (
    "{block} treats the tokens before `{count}` apart (`x[:, :{param}]`): a count from the start of the whole "
    "sequence, which the token split does not carry"
)


def _switched_blocks(mod: Module, cls: str) -> list[tuple[str, str, str]]:
    """(config condition, block list attribute, block class) per `self.<attr> = ...Block(...)` that `cls.__init__`
    assigns under `if <param> == <literal>:`."""
    out = []
    for branch in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.If)):
        test = branch.test
        if not (isinstance(test, cst.Comparison) and isinstance(test.left, cst.Name) and len(test.comparisons) == 1):
            continue
        target = test.comparisons[0]
        if not isinstance(target.operator, cst.Equal) or not isinstance(target.comparator, cst.SimpleString):
            continue
        when = normalize(f"self.config.{test.left.value} == {target.comparator.value}", "eval")
        for assign in nodes(branch.body, lambda n: isinstance(n, cst.Assign)):
            attr = dotted(assign.targets[0].target) or ""
            built = [dotted(c.func) for c in nodes(assign.value, lambda n: isinstance(n, cst.Call))]
            blocks = [b for b in built if b in mod.classes]
            if attr.startswith("self.") and blocks:
                out.append((when, attr[5:], blocks[0]))
    return out


def _sliced_param(mod: Module, block: str) -> tuple[int, str] | None:
    """(position, name) of the block forward's parameter that bounds a token slice (`x[:, :num_tokens]`)."""
    forward = mod.method(block, "forward")
    params = [p.name.value for p in forward.params.params[1:]] if forward is not None else []
    bounds = {dotted(s.upper) for s in nodes(forward, lambda n: isinstance(n, cst.Slice) and n.upper is not None)}
    sliced = [(i, p) for i, p in enumerate(params) if p in bounds]
    return sliced[0] if len(sliced) == 1 else None


def _passed(forward: cst.FunctionDef, attr: str, position: int) -> str | None:
    """The name the forward hands, at `position`, to each block of `for block in self.<attr>:` (a direct call)."""
    names = set()
    for loop in nodes(forward, lambda n: isinstance(n, cst.For) and dotted(n.iter) == f"self.{attr}"):
        calls = nodes(loop.body, lambda n: isinstance(n, cst.Call))
        for call in [c for c in calls if dotted(c.func) == dotted(loop.target)]:
            args = [a for a in call.args if a.keyword is None]
            names.add(dotted(args[position].value) if position < len(args) else None)
    return names.pop() if len(names) == 1 else None


def global_token_counts(mod: Module, cls: str, body: list[cst.CSTNode]) -> list[tuple[dict, str, str]]:
    """(vars of dit/refuse_under_sp, the `after` anchor: the statement computing the count, note) per switch."""
    forward = mod.method(cls, "forward")
    out: list[tuple[dict, str, str]] = []
    for when, attr, block in _switched_blocks(mod, cls):
        sliced = _sliced_param(mod, block)
        count = _passed(forward, attr, sliced[0]) if sliced is not None else None
        site = next((s for s in body if count is not None and assign_of(s)[0] == count), None)
        if site is None or any(v["when"] == when for v, _, _ in out):
            continue
        reason = REASON.format(block=block, count=count, param=sliced[1])
        note = f"{block} slices tokens at `{sliced[1]}` = the forward's `{count}` under `{when}` at {mod.where(site)}"
        out.append(({"when": when, "reason": reason}, canonical(site), note))
    return out
