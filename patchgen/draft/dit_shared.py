"""A DiT whose blocks build attention processors defined in diffusers' shared modules (attention_processor.py:
SD3's JointAttnProcessor2_0, AuraFlow's, CogVideoX's) that call `F.scaled_dot_product_attention` on (batch, heads,
seq, dim) tensors. Those processors are companions (redefined beside the generated module, with any shared-module
block that builds them), and the split reaches them as a processor parameter (`dit_sp`) through the kwargs dict the
forward hands its blocks and the blocks hand `self.attn`: put into that dict before the blocks run where every block
call passes it, else handed to each block call and put into the dict inside the block. A RoPE table the forward
takes as an input is sliced on the token dim diffusers' `apply_rotary_emb` reads it on. What cannot be read is a
reason naming file:line."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.dit_layout import assign_of, canonical, gather_found, layout_plan
from patchgen.draft.dit_rotary import table_token_dim
from patchgen.draft.recognised import Found, Recognised
from patchgen.draft.structure import Module, dotted, nodes
from patchgen.draft.upstream_names import Modules
from patchgen.upstream import UpstreamSource

SDPA = "F.scaled_dot_product_attention"
CHECKPOINT = "self._gradient_checkpointing_func"
CARRIER = "dit_sp"
TEXT = ("encoder_", "txt_", "text_")  # the text stream, which stays whole on every rank
WHY = {
    "tokens": "each SP rank runs the blocks on its slice of the patchified tokens; text stays whole",
    "rotary": "this rank's slice of the RoPE tables the forward takes (None without RoPE)",
    "carry": "no RoPE carries the split: it reaches the processors through the kwargs the blocks pass them",
    "pass": "the block receives the split: upstream calls it here without the kwargs its attention takes",
    "block": "the block takes the split and hands it to its attention through the kwargs it passes self.attn",
    "parameter": "diffusers' Attention passes a processor only the kwargs its signature names: it takes the split",
    "heads": "attention in (b, h, s, d): tokens all-to-all to this rank's heads (text, when joined, keeps its heads)",
    "sequence": "and back to this rank's tokens x all heads",
    "ring": "under a ring the attention runs ring attention over the ring group (K/V passed around)",
}


@dataclass(frozen=True)
class Loop:
    """A loop of the forward over a block list: its block class (module, name) and the calls of the block in it."""

    attr: str
    block: tuple[str, str]
    calls: list[cst.Call]


def shared_attention(mod: Module, cls: str, source: UpstreamSource, out: Recognised, missing: list[str]) -> bool:
    """True when `cls`'s blocks build a processor of a shared diffusers module: its patches and companions in
    `out`, or what draft cannot read in `missing`. False (nothing added) for any other structure."""
    forward = mod.method(cls, "forward")
    if forward is None or mod.class_attr(cls, "_cp_plan") is not None:
        return False
    modules = Modules(source, out.target.module, mod)
    loops = _loops(modules, mod, cls, forward)
    found = {b: _processors(modules, *b) for b in dict.fromkeys(loop.block for loop in loops)}
    package = out.target.module.rsplit(".", 1)[0]  # diffusers.models.transformers: the models' own modules
    shared = [p for ps in found.values() for p in ps if p[0].rsplit(".", 1)[0] != package]
    if not shared:  # none, or the model's own: other readers' structures; or processors Attention picks itself
        defaulted = (
            [] if any(found.values()) else [r for b in found for r in _picked_by_attention(modules, *b, package)]
        )
        missing.extend(defaulted)
        return bool(defaulted)
    processors = list(dict.fromkeys(shared))
    for pmod, name in processors:
        calls = _sdpa_calls(modules.get(pmod), name)
        if len(calls) != 1:
            where = modules.get(pmod).where(modules.get(pmod).classes[name])
            missing.append(f"{name} ({where}) calls {SDPA} {len(calls)} times, not once: no SP form of it is read")
    own = [p for ps in found.values() for p in ps if p not in shared]
    if own:
        missing.append(f"{', '.join(p[1] for p in own)} of a model's module beside shared processors: not read")
    body = list(forward.body.body)
    first = next((i for i, s in enumerate(body) if any(_calls_blocks(s, loop) for loop in loops)), len(body))
    tokens = [i for i, s in enumerate(body[:first]) if assign_of(s)[0] == "hidden_states"]
    unimported = [p for _, p in processors if modules.origin(out.target.module, p) is None]
    if unimported:
        missing.append(f"{', '.join(unimported)}: not imported by {mod.upstream.relpath}, the split cannot name it")
    if first == len(body):
        missing.append(f"{cls}.forward ({mod.where(forward)}) runs its blocks in no statement of its own body")
    elif not tokens:
        missing.append(f"{cls}.forward ({mod.where(forward)}) assigns no hidden_states before its blocks run")
    computed = [s for s in body[:first] if "rotary" in (assign_of(s)[0] or "") or "freqs" in (assign_of(s)[0] or "")]
    if computed:  # tables the forward builds for the processors: not read on this path
        missing.append(
            f"{cls}.forward computes RoPE tables ({mod.where(computed[0])}) for shared processors: not read"
        )
    if missing:
        return True
    anchor = {"anchor": _text(body[tokens[-1]]), "place": "after"}
    note = f"blocks of {cls} build {', '.join(p for _, p in processors)} (shared modules), no RoPE computed"
    scope = f"{cls}.forward"
    tvars = {"tokens": ["hidden_states"], "processors": [p for _, p in processors]}
    out.patches.append(Found("dit/shard_tokens", scope, WHY["tokens"], note, vars=tvars, **anchor))
    rotary = _rotary_input(modules, forward, processors, missing)
    if rotary is not None:
        rvars = {"rotary": rotary[0], "dim": rotary[1]}
        out.patches.append(Found("dit/shard_rotary", scope, WHY["rotary"], rotary[2], vars=rvars, **anchor))
    _route(modules, mod, cls, forward, body[first - 1], loops, out, missing)
    for pmod, name in processors:
        _attention(modules.get(pmod), name, out)
    _gather(mod, cls, out, missing)
    if not missing:
        out.companions += _companions(modules, out.target.module, processors, found)
    return True


def _text(node: cst.CSTNode) -> str:
    """A statement's anchor: its canonical one-line text, or the header of a compound statement."""
    if isinstance(node, cst.If):
        return f"if {canonical(node.test, 'eval')}:"
    return canonical(node)


def _loops(modules: Modules, mod: Module, cls: str, forward: cst.FunctionDef) -> list[Loop]:
    """The forward's loops `for ..., block in enumerate(self.<...blocks>)`, each with the class its list holds."""
    built = dict(_built_lists(modules, mod, cls))
    out = []
    for loop in nodes(forward, lambda n: isinstance(n, cst.For)):
        it = (
            loop.iter.args[0].value
            if isinstance(loop.iter, cst.Call) and dotted(loop.iter.func) == "enumerate"
            else loop.iter
        )
        attr = (dotted(it) or "").removeprefix("self.")
        target = loop.target.elements[-1].value if isinstance(loop.target, cst.Tuple) else loop.target
        if attr not in built or not isinstance(target, cst.Name):
            continue
        calls = nodes(loop.body, lambda n, name=target.value: isinstance(n, cst.Call) and _calls_block(n, name))
        out.append(Loop(attr, built[attr], calls))
    return out


def _calls_block(call: cst.Call, name: str) -> bool:
    """`block(...)`, or `self._gradient_checkpointing_func(block, ...)`."""
    if dotted(call.func) == name:
        return True
    return dotted(call.func) == CHECKPOINT and bool(call.args) and dotted(call.args[0].value) == name


def _built_lists(modules: Modules, mod: Module, cls: str) -> list[tuple[str, tuple[str, str]]]:
    """(attr, (module, class)) of `self.attr = nn.ModuleList([Cls(...) ...])` in `cls.__init__`, Cls wherever
    it is defined (the model's module or one it imports it from)."""
    out = []
    for node in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.Assign)):
        target = dotted(node.targets[0].target) or ""
        value = node.value
        if (
            not target.startswith("self.")
            or not isinstance(value, cst.Call)
            or "ModuleList" not in code_of(value.func)
        ):
            continue
        for inner in nodes(value, lambda n: isinstance(n, cst.Call) and isinstance(n.func, cst.Name)):
            origin = modules.origin(modules.name_of(mod), inner.func.value)
            if origin is not None:
                out.append((target[5:], origin))
                break
    return out


def _processors(modules: Modules, module: str, cls: str) -> list[tuple[str, str]]:
    """The attention processors a block builds in its __init__ (`processor=X()` or `processor = X()`): classes
    whose `__call__` takes the attention module first (`attn`), wherever they are defined."""
    mod = modules.get(module)
    out = []
    for call in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.Call) and isinstance(n.func, cst.Name)):
        origin = modules.origin(module, call.func.value)
        if origin is None or origin in out:
            continue
        method = modules.get(origin[0]).method(origin[1], "__call__")
        params = [p.name.value for p in method.params.params] if method is not None else []
        if params[1:2] == ["attn"]:
            out.append(origin)
    return out


def _picked_by_attention(modules: Modules, module: str, cls: str, package: str) -> list[str]:
    """The block's attention modules built with no `processor=` from a class of a shared module whose __init__ takes
    one (BasicTransformerBlock's `Attention(...)`): that class picks its default processor itself, for self- and
    cross-attention alike, and no call of it in a processor draft reads. `package`: the models' own modules'."""
    mod = modules.get(module)
    for call in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.Call) and isinstance(n.func, cst.Name)):
        origin = modules.origin(module, call.func.value)
        if origin is None or origin[0].rsplit(".", 1)[0] == package:  # a class of the models' own modules
            continue
        init = modules.get(origin[0]).method(origin[1], "__init__")
        params = [p.name.value for p in init.params.params] if init is not None else []
        if "processor" in params and "processor" not in {a.keyword.value for a in call.args if a.keyword}:
            picked = f"{cls} ({mod.where(call)}) builds {origin[1]} with no processor"
            return [f"{picked}: {origin[1]} picks its default itself, for self- and cross-attention alike; not read"]
    return []


def _sdpa_calls(mod: Module, processor: str) -> list[cst.Call]:
    return nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Call) and dotted(n.func) == SDPA)


def _calls_blocks(stmt: cst.CSTNode, loop: Loop) -> bool:
    return any(c in loop.calls for c in nodes(stmt, lambda n: isinstance(n, cst.Call)))


def _rotary_input(
    modules: Modules, forward: cst.FunctionDef, processors: list[tuple[str, str]], missing: list[str]
) -> tuple[str, int, str] | None:
    """(forward input, token dim, note) of a RoPE table the forward takes and its processors rotate with
    diffusers' `apply_rotary_emb`; None when the forward takes none."""
    names = [p.name.value for p in forward.params.params if "rotary" in p.name.value]
    if not names:
        return None
    for pmod, name in processors:
        dim, note = table_token_dim(modules, pmod, name)
        if dim is None:
            missing.append(note)
            return None
    return names[0], dim, note


def _route(
    modules: Modules,
    mod: Module,
    cls: str,
    forward: cst.FunctionDef,
    before_blocks: cst.CSTNode,
    loops: list[Loop],
    out: Recognised,
    missing: list[str],
) -> None:
    """How the split reaches the processors: the forward's kwargs dict (`*attention_kwargs`), carried into it
    before the blocks run where every block call passes it, else handed to each block call and carried inside."""
    scope = f"{cls}.forward"
    kwargs = [p.name.value for p in forward.params.params if p.name.value.endswith("attention_kwargs")]
    if len(kwargs) != 1:
        missing.append(f"{scope} ({mod.where(forward)}) takes {len(kwargs)} *attention_kwargs dicts, not one")
        return
    [dict_name] = kwargs
    calls = [c for loop in loops for c in loop.calls]
    passing = [c for c in calls if any(dotted(a.value) == dict_name for a in c.args)]
    if len(passing) == len(calls):
        note = f"every block call of {scope} passes `{dict_name}` ({mod.where(before_blocks)})"
        place = {"anchor": _text(before_blocks), "place": "after"}
        out.patches.append(Found("dit/carry_split", scope, WHY["carry"], note, vars={"kwargs": dict_name}, **place))
        return
    for call in calls:
        note = f"a block call at {mod.where(call)}" + ("" if call in passing else f" without `{dict_name}`")
        callee = dotted(call.func)
        out.patches.append(
            Found("dit/pass_split", scope, WHY["pass"], note, canonical(call, "eval"), vars={"callee": callee})
        )
    for block in dict.fromkeys(loop.block for loop in loops):
        _carry_in_block(modules.get(block[0]), block[1], dict_name, out, missing)


def _carry_in_block(mod: Module, block: str, dict_name: str, out: Recognised, missing: list[str]) -> None:
    """The block takes `dit_sp` and puts it into the kwargs dict it passes `self.<attn>(**dict)`: after the dict's
    last assignment before that call (`attention_kwargs = attention_kwargs or {}`), else before the call."""
    forward = mod.method(block, "forward")
    body = list(forward.body.body) if forward is not None else []
    spread = [
        i
        for i, s in enumerate(body)
        if nodes(s, lambda n: isinstance(n, cst.Arg) and n.star == "**" and dotted(n.value) == dict_name)
    ]
    if not spread:
        where = mod.where(forward or mod.classes[block])
        missing.append(f"{block}.forward ({where}) passes no `**{dict_name}` to its attention")
        return
    scope = f"{block}.forward"
    out.patches.append(
        Found("core/add_parameter", scope, WHY["block"], f"{block} at {mod.where(forward)}", vars={"name": CARRIER})
    )
    assigned = [i for i in range(spread[0]) if assign_of(body[i])[0] == dict_name]
    at = (
        {"anchor": _text(body[assigned[-1]]), "place": "after"}
        if assigned
        else {"anchor": _text(body[spread[0]]), "place": "before"}
    )
    note = f"`**{dict_name}` handed to the attention at {mod.where(body[spread[0]])}"
    out.patches.append(Found("dit/carry_split", scope, WHY["block"], note, vars={"kwargs": dict_name}, **at))


def _attention(mod: Module, name: str, out: Recognised) -> None:
    """The processor's parameter, the all-to-all pair around its one `F.scaled_dot_product_attention` call (torch's
    layout: (batch, heads, seq, dim)), and the ring wrapped around it."""
    scope = f"{name}.__call__"
    method = mod.method(name, "__call__")
    [call] = _sdpa_calls(mod, name)
    note = f"{SDPA} of {name} at {mod.where(call)}"
    out.patches.append(Found("core/add_parameter", scope, WHY["parameter"], note, vars={"name": CARRIER}))
    statement = next(
        s for s in nodes(method, lambda n: isinstance(n, cst.SimpleStatementLine)) if nodes(s, lambda n: n is call)
    )
    tensors = [code_of(a.value) for a in call.args if a.keyword is None][:3]
    hvars: dict = {"tensors": tensors, "carrier": CARRIER, "replicated": _replicated(mod, name, tensors[0])}
    hvars["dims"] = "bhsd"
    mask = next((code_of(a.value) for a in call.args if a.keyword and a.keyword.value == "attn_mask"), None)
    params = [p.name.value for p in method.params.params]
    if mask is None and "attention_mask" not in params:
        hvars["mask"] = "None"  # upstream attends unmasked and takes no mask
    elif mask is not None and mask != "attention_mask":
        hvars["mask"] = mask
    text = canonical(statement)
    out.patches.append(Found("dit/ulysses_to_heads", scope, WHY["heads"], note, text, vars=hvars, place="before"))
    result = assign_of(statement)[0]
    out.patches.append(
        Found("dit/ulysses_to_sequence", scope, WHY["sequence"], note, text, vars={"tensor": result}, place="after")
    )
    out.patches.append(
        Found("dit/ring_attention", scope, WHY["ring"], note, canonical(call, "eval"), vars={"callee": SDPA})
    )


def _replicated(mod: Module, processor: str, tensor: str) -> str:
    """Where the replicated text sits in the sequence attended over: the first or last part of the `torch.cat`
    assigned to the query, or to the states it is projected from (`query = attn.to_q(hidden_states)`); none."""
    assigns = nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Assign))
    names = [tensor]
    for node in assigns:
        value = node.value
        if dotted(node.targets[0].target) == tensor and isinstance(value, cst.Call) and len(value.args) == 1:
            if (dotted(value.func) or "").startswith("attn.to_") and dotted(value.args[0].value):
                names.append(dotted(value.args[0].value))
    for node in assigns:
        value = node.value
        if (
            dotted(node.targets[0].target) in names
            and isinstance(value, cst.Call)
            and dotted(value.func) == "torch.cat"
        ):
            parts = value.args[0].value
            if isinstance(parts, cst.List | cst.Tuple):
                first = dotted(parts.elements[0].value) or ""
                return "first" if first.startswith(TEXT) else "last"
    return "none"


def _gather(mod: Module, cls: str, out: Recognised, missing: list[str]) -> None:
    """The gather after the output projection, as diffusers' plan would state it (dit_layout)."""
    entries, reason = layout_plan(mod, cls, None)
    if reason:
        missing.append(reason)
        return
    [output] = [e[0] for e in entries if e[2] == "ContextParallelOutput"]
    body = list(mod.method(cls, "forward").body.body)
    sites = [
        s for s in body if (v := assign_of(s)[1]) is not None and dotted(getattr(v, "func", None)) == f"self.{output}"
    ]
    if len(sites) != 1:
        missing.append(f"{cls}.forward ({mod.where(mod.method(cls, 'forward'))}): self.{output} is not called once")
        return
    note = f"gather the output of `{_text(sites[0])}` at {mod.where(sites[0])}"
    out.patches.append(gather_found(f"{cls}.forward", assign_of(sites[0])[0], _text(sites[0]), note))


def _companions(
    modules: Modules,
    main: str,
    processors: list[tuple[str, str]],
    found: dict[tuple[str, str], list[tuple[str, str]]],
) -> list[tuple[str, list[str]]]:
    """(module, classes to redefine) per shared module: the processors, then the shared-module blocks that build
    them (so that the redefined block builds the patched processor)."""
    keep: dict[str, list[str]] = {}
    for module, name in [*processors, *(b for b, ps in found.items() if any(p in processors for p in ps))]:
        if module != main and name not in keep.setdefault(module, []):
            keep[module].append(name)
    return list(keep.items())
