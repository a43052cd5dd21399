"""A DiT's attention processors as draft reads them: the default processor of each attention module the class
reaches, its one attention call (`dispatch_attention_fn` handed diffusers' parallel config, else torch's
`F.scaled_dot_product_attention`), the argument carrying the RoPE tables (and the split) into it, and the all-to-all
pair and ring placed around that call."""

from __future__ import annotations

from typing import Any

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.dit_layout import assign_of, canonical
from patchgen.draft.recognised import Found, Recognised
from patchgen.draft.structure import Module, dotted, nodes

TEXT = ("encoder_", "txt_", "text_")  # names of the text stream, which stays whole on every rank
DISPATCH = "dispatch_attention_fn"
SDPA = ("F.scaled_dot_product_attention", "torch.nn.functional.scaled_dot_product_attention")  # (b, h, s, d)
WHY_HEADS = "attention sees every token: all-to-all to this rank's heads (text, when joined, keeps its heads)"
WHY_SEQUENCE = "and back to this rank's tokens x all heads"
WHY_RING = "under a ring the attention runs ring attention over the ring group (K/V passed around)"
WHY_TENSOR = "the processor applies its RoPE as one complex tensor: take the split the wrapped RoPE carries"


def default_processors(mod: Module, reachable: list[str]) -> list[tuple[str, cst.Call]]:
    """(processor, its attention call) for each default processor of the reachable attention modules (`processor=
    X()` or `_default_processor_cls = X`) whose __call__ hands diffusers' parallel config to one dispatch call, or
    makes one `F.scaled_dot_product_attention` call (a processor of this module written before diffusers' dispatch:
    Lumina2's)."""
    named: list[str] = []
    for cls in reachable:
        node = mod.classes.get(cls)
        default = mod.class_attr(cls, "_default_processor_cls")
        if default in mod.classes and default not in named:
            named.append(default)
        for arg in nodes(node, lambda n: isinstance(n, cst.Arg) and n.keyword is not None):
            if arg.keyword.value == "processor" and isinstance(arg.value, cst.Call):
                name = dotted(arg.value.func)
                if name in mod.classes and name not in named:
                    named.append(name)
    out = []
    for name in sorted(named, key=list(mod.classes).index):
        calls = [
            c
            for c in nodes(
                mod.method(name, "__call__"), lambda n: isinstance(n, cst.Call) and dotted(n.func) == DISPATCH
            )
            if any(
                a.keyword is not None
                and a.keyword.value == "parallel_config"
                and "self._parallel_config" in code_of(a.value)
                for a in c.args
            )
        ]
        if len(calls) > 1:  # SkyReels-V2: an image cross-attention beside the self-attention
            calls = [c for c in calls if rotated(mod, name, c)]
        if not calls:
            calls = nodes(mod.method(name, "__call__"), lambda n: isinstance(n, cst.Call) and dotted(n.func) in SDPA)
        if len(calls) == 1:
            out.append((name, calls[0]))
    return out


def rotated(mod: Module, processor: str, call: cst.Call) -> bool:
    """Whether the call's key (its second positional argument) is assigned from the processor's RoPE parameter
    (`key = apply_rotary_emb(key, *rotary_emb)`): the self-attention among several parallelised calls."""
    carrier = rotary_param(mod, processor)
    args = [a for a in call.args if a.keyword is None]
    key = dotted(args[1].value) if len(args) > 1 else None
    if carrier is None or key is None:
        return False
    return any(
        dotted(node.targets[0].target) == key
        and any(n.value == carrier for n in nodes(node.value, lambda n: isinstance(n, cst.Name)))
        for node in nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Assign))
    )


def rotary_parts(mod: Module, processors: list[tuple[str, cst.Call]]) -> list[int] | None:
    """The parts of a RoPE tuple that belong to the tokens, when a processor unpacks it into named parts of which
    some are the text's (`img_freqs, txt_freqs = image_rotary_emb`); None: every part is per token (cos, sin)."""
    for name, _ in processors:
        carrier = rotary_param(mod, name)
        for node in nodes(mod.method(name, "__call__"), lambda n: isinstance(n, cst.Assign)):
            target = node.targets[0].target
            if dotted(node.value) == carrier and isinstance(target, cst.Tuple):
                names = [dotted(e.value) or "" for e in target.elements]
                if any(n.startswith(TEXT) for n in names):
                    return [i for i, n in enumerate(names) if not n.startswith(TEXT)]
    return None


def rotary_param(mod: Module, processor: str) -> str | None:
    """The processor's one `*rotary*` parameter (the RoPE tables, which carry the split), else None."""
    call = mod.method(processor, "__call__")
    params = [p.name.value for p in call.params.params] if call is not None else []
    rotary = [p for p in params if "rotary" in p]
    return rotary[0] if len(rotary) == 1 else None


def attention(mod: Module, name: str, call: cst.Call, out: Recognised) -> None:
    """The all-to-all pair around the processor's parallelised attention call, and the ring wrapped around it."""
    scope = f"{name}.__call__"
    statement = next(
        s
        for s in nodes(mod.method(name, "__call__"), lambda n: isinstance(n, cst.SimpleStatementLine))
        if any(n is call for n in nodes(s, lambda n: isinstance(n, cst.Call)))
    )
    tensors = [code_of(a.value) for a in call.args if a.keyword is None][:3]
    first = cat_of(mod, name, tensors[0])
    replicated = "none" if first is None else "first" if first[0].startswith(TEXT) else "last"
    mask = next((code_of(a.value) for a in call.args if a.keyword and a.keyword.value == "attn_mask"), "None")
    callee = dotted(call.func)
    carrier = rotary_param(mod, name)
    note = f"{DISPATCH} with diffusers' parallel config at {mod.where(call)}"
    if callee in SDPA:
        note = f"{callee} of this module's processor at {mod.where(call)}"
    if carrier is not None and complex_rotary(mod, name, carrier):  # unwrapped first, the split in `dit_sp`
        first = canonical(mod.method(name, "__call__").body.body[0])
        rvars = {"rotary": carrier}
        out.patches.append(Found("dit/rotary_tensor", scope, WHY_TENSOR, note, first, vars=rvars, place="before"))
        carrier = "dit_sp"
    hvars: dict[str, Any] = {"tensors": tensors, "carrier": carrier, "replicated": replicated}
    hvars["dims"] = "bhsd" if callee in SDPA else "bshd"  # torch's SDPA: (b, h, s, d); dispatch_attention_fn: bshd
    if mask != "attention_mask":
        hvars["mask"] = mask
    text = canonical(statement)
    out.patches.append(Found("dit/ulysses_to_heads", scope, WHY_HEADS, note, text, vars=hvars, place="before"))
    result = assign_of(statement)[0]
    out.patches.append(
        Found("dit/ulysses_to_sequence", scope, WHY_SEQUENCE, note, text, vars={"tensor": result}, place="after")
    )
    ring = Found("dit/ring_attention", scope, WHY_RING, note, canonical(call, "eval"), vars={"callee": callee})
    out.patches.append(ring)


def complex_rotary(mod: Module, processor: str, rotary: str) -> bool:
    """Whether the processor hands its RoPE parameter to `apply_rotary_emb(x, rotary, use_real=False)`: one complex
    tensor (Lumina2's freqs_cis), not a (cos, sin) tuple, so it cannot itself carry the split."""
    calls = nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Call))
    return any(
        dotted(c.func) == "apply_rotary_emb"
        and any(dotted(a.value) == rotary for a in c.args)
        and any(a.keyword is not None and a.keyword.value == "use_real" and dotted(a.value) == "False" for a in c.args)
        for c in calls
    )


def cat_of(mod: Module, processor: str, name: str) -> list[str] | None:
    """The parts of `name = torch.cat([a, b], dim=1)` in the processor (a joint [text, image] sequence)."""
    for node in nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Assign)):
        if dotted(node.targets[0].target) == name and isinstance(node.value, cst.Call):
            if dotted(node.value.func) == "torch.cat" and isinstance(node.value.args[0].value, cst.List | cst.Tuple):
                return [dotted(e.value) or "" for e in node.value.args[0].value.elements]
    return None
