"""Recognising a decoder LM's mixture of experts: the load-balancing loss (it must see every rank's tokens) and the
stacked experts that expert parallelism splits, served through transformers' experts interface; experts any other
way are an `ep` reason in `[model.unsupported]`."""

from __future__ import annotations

import re

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.recognised import Found, Recognised
from patchgen.draft.structure import Module, dotted, nodes, walk

WHY = {
    "aux": "the load-balancing loss must see every rank's tokens, not one rank's slice",
    "ep": "expert parallelism splits the stacked experts over the ep group; the runtime reads this plan",
}


def moe(mod: Module, lm: str, model: str, pretrained: str, out: Recognised) -> None:
    """The MoE structures of `lm` (its decoder `model`): the aux loss and the EP plan, or an `ep` reason."""
    layers = mod.paths(model)
    layer = next((cls for cls, paths in layers.items() if paths == ["layers"]), None)
    experts = [cls for cls, paths in layers.items() if any(p.split(".")[-1] == "experts" for p in paths)]
    if not experts:
        return
    out.facts["moe"] = True
    forward = mod.method(lm, "forward")
    aux = nodes(forward, lambda n: isinstance(n, cst.Name) and n.value == "load_balancing_loss_func")
    if len(aux) == 1:
        note = f"load-balancing loss `load_balancing_loss_func` at {mod.where(aux[0])}"
        out.patches.append(Found("moe/global_aux_loss", f"{lm}.forward", WHY["aux"], note, anchor=aux[0].value))
        out.facts["aux_loss"] = True
    elif aux:
        out.unsupported["ep"] = (
            f"load_balancing_loss_func named {len(aux)} times in {lm}.forward ({mod.where(aux[0])})"
        )
        return
    [cls] = experts[:1]
    decorators = {
        dotted(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator)
        for d in mod.classes[cls].decorators
    }
    if "use_experts_implementation" not in decorators:  # the EP kernels are served through transformers' interface
        forward = mod.method(cls, "forward")
        takes = ", ".join(p.name.value for p in forward.params.params[1:]) if forward is not None else "-"
        out.unsupported["ep"] = (
            f"experts {cls} ({mod.where(mod.classes[cls])}) are not declared to use_experts_implementation: its "
            f"forward takes ({takes}), no routed (token, expert) dispatch for the EP all-to-all"
        )
        return
    stacked = _stacked_params(mod, cls)
    within = [p for p in mod.paths(layer).get(cls, [])] if layer is not None else []
    if not stacked or len(within) != 1:
        where = mod.where(mod.classes[cls])
        out.unsupported["ep"] = f"experts {cls} ({where}) are not one set of stacked (E, ...) parameters per layer"
        return
    params = [f"{within[0]}.{p}" for p in stacked]
    why = WHY["ep"] if len(stacked) == 2 else WHY["ep"].replace("stacked experts", "stacked experts and their biases")
    note = f"stacked experts {cls} ({mod.where(mod.classes[cls])}): {', '.join(stacked)}, dim 0 = experts"
    out.patches.append(Found("moe/ep_plan", pretrained, why, note, vars={"params": params}))


def _stacked_params(mod: Module, cls: str) -> list[str]:
    """`self.p = nn.Parameter(torch.empty(self.num_experts, ...))` of an experts class, in definition order."""
    names = []
    for node in walk(mod.method(cls, "__init__") or mod.classes[cls]):
        if (
            isinstance(node, cst.Assign)
            and isinstance(node.value, cst.Call)
            and dotted(node.value.func) == "nn.Parameter"
        ):
            target = dotted(node.targets[0].target) or ""
            shape = code_of(node.value.args[0].value) if node.value.args else ""
            if target.startswith("self.") and re.search(r"\(\(?self\.num_experts\b", shape):
                names.append(target[5:])
    return names
