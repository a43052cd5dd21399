"""Recognising what a decoder LM computes from token positions besides RoPE, and which classes it never runs: the
rotary embedding's output form (a (cos, sin) pair or one tensor of complex frequencies), absolute positions an
attention layer derives from its own sequence length (`torch.arange(hidden_states.shape[1])`: Llama 4's attention
temperature tuning), a decoder layer that takes the position ids but does not hand them to its attention, and the
attention classes of another model in the same module (a VLM's vision tower) that the LM does not build."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.structure import Module, dotted, nodes

WHY_GLOBAL = (
    "absolute positions derived from the layer's own sequence length: under SP a rank's tokens sit at their global "
    "row indices, not at 0"
)
WHY_PASS = (
    "the decoder layer takes the position ids but does not pass them to its attention: ring attention finds the "
    "packed documents from them"
)


def rope_form(mod: Module, model: str) -> tuple[str, str] | None:
    """("tensor", where) when the rotary embedding `model` builds returns one value (complex frequencies), not a
    (cos, sin) tuple; None for a pair or a class draft cannot find (the template checks the form at run time)."""
    cls = next((c for attr, c in mod.built(model) if attr == "rotary_emb"), None)
    forward = mod.method(cls, "forward") if cls is not None else None
    returns = [r for r in nodes(forward, lambda n: isinstance(n, cst.Return)) if r.value is not None]
    if not returns or any(isinstance(r.value, cst.Tuple) for r in returns):
        return None
    return "tensor", f"{cls}.forward returns `{code_of(returns[0].value)}` at {mod.where(returns[0])}"


def local_arange(mod: Module, cls: str) -> list[tuple[str, str]]:
    """(anchor, where) for each `torch.arange(<x>.shape[1], ...)` in `cls.forward`: positions 0..n-1 of the tokens
    the layer holds, which under SP are not the tokens' row positions."""
    found = []
    for call in nodes(mod.method(cls, "forward"), lambda n: isinstance(n, cst.Call)):
        if dotted(call.func) != "torch.arange" or not call.args or call.args[0].keyword is not None:
            continue
        first = call.args[0].value
        if (
            isinstance(first, cst.Subscript)
            and isinstance(first.value, cst.Attribute)
            and first.value.attr.value == "shape"
            and code_of(first.slice[0].slice).strip() == "1"
        ):
            found.append((code_of(call), mod.where(call)))
    return found


def unpassed_position_ids(mod: Module, model: str, sites: set[str]) -> list[tuple[str, str, str]]:
    """(layer class, anchor `self.<attn>`, where) for a decoder layer of `model` whose forward takes `position_ids`
    but calls its attention module (a class in `sites`) without them."""
    out = []
    for layer, paths in mod.paths(model).items():
        forward = mod.method(layer, "forward")
        if paths != ["layers"] or forward is None:
            continue
        if "position_ids" not in {p.name.value for p in forward.params.params}:
            continue
        for attr, cls in mod.built(layer):
            if cls not in sites:
                continue
            calls = nodes(forward, lambda n, a=attr: isinstance(n, cst.Call) and dotted(n.func) == f"self.{a}")
            if len(calls) == 1 and not any(
                (arg.keyword is not None and arg.keyword.value == "position_ids")
                or (arg.keyword is None and arg.star == "" and code_of(arg.value) == "position_ids")
                for arg in calls[0].args
            ):
                out.append((layer, f"self.{attr}", mod.where(calls[0])))
    return out


def other_models(mod: Module, lm: str, pretrained: str) -> dict[str, str]:
    """class -> the other model (a `pretrained` subclass the LM does not build, e.g. a vision tower) that builds it,
    for the classes the LM itself does not build: they are reachable (named in `_init_weights`) but never run."""
    own = mod.paths(lm)
    out: dict[str, str] = {}
    for name, node in mod.classes.items():
        bases = {dotted(b.value) for b in node.bases}
        if name == lm or name in own or pretrained not in bases:
            continue
        for cls in mod.paths(name):
            if cls not in own:
                out.setdefault(cls, name)
    return out
