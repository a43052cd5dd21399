"""Recognising an `_init_weights` that transformers would skip for a generated class: transformers counts a class
defined outside its package as custom code and then skips `_init_weights` for every module without direct
parameters or buffers, so a branch that initialises such a module (an MoE block setting its router's weight through
`module.gate.weight`) would leave a randomly initialised generated model with uninitialised memory there
(template core/native_weight_init)."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.structure import Module, dotted, nodes

INIT_WHY = "random init as upstream's: _init_weights initialises {cls}, which has no direct parameter or buffer"
CONTAINERS = ("nn.Module", "torch.nn.Module", "GradientCheckpointingLayer")  # bases that hold no parameter


def parameterless_inits(mod: Module, pretrained: str) -> list[tuple[str, str]]:
    """(class, where) for each `isinstance(module, <class>)` branch of `pretrained._init_weights` whose class holds
    no parameter or buffer of its own (it builds submodules only): transformers skips it for custom code."""
    out = []
    for call in nodes(mod.method(pretrained, "_init_weights"), lambda n: isinstance(n, cst.Call)):
        if dotted(call.func) != "isinstance" or len(call.args) != 2:
            continue
        cls = dotted(call.args[1].value)
        if cls in mod.classes and not _own_state(mod, cls) and cls not in [c for c, _ in out]:
            out.append((cls, mod.where(call)))
    return out


def _own_state(mod: Module, cls: str) -> bool:
    node = mod.classes[cls]
    for base in node.bases:
        name = dotted(base.value)
        if name in mod.classes:
            if _own_state(mod, name):
                return True
        elif name not in CONTAINERS:  # nn.Linear, nn.Embedding, ...: parameters of their own
            return True
    return bool(
        nodes(
            node,
            lambda n: (
                isinstance(n, cst.Call)
                and (
                    dotted(n.func) in ("nn.Parameter", "torch.nn.Parameter")
                    or code_of(n.func).endswith(("register_parameter", "register_buffer"))
                )
            ),
        )
    )
