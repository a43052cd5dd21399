"""Recognising a diffusers transformer's structures that the shipped DiT kinds serve. What to split is read from
the class's own context-parallel plan (`_cp_plan`: the inputs diffusers splits over tokens and the output it
gathers), else the plan diffusers would state, read from the forward's layout (`dit_layout`); where, from the
forward: after the RoPE tables and the patchified tokens exist. The attention call is the
`dispatch_attention_fn` call of the default processor that diffusers itself parallelises (`parallel_config=
self._parallel_config`). Anything else is a `[model.unsupported]` reason naming file:line, never a guess."""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import libcst as cst

from patchgen.cst.locate import code_of, normalize
from patchgen.cst.prune import parsed, reachable_definitions
from patchgen.draft.dit_frames import per_frame, token_masks
from patchgen.draft.dit_layout import (
    assign_of,
    grid_rotary_dim,
    init_call,
    layout_plan,
    per_token_timestep,
    self_call,
)
from patchgen.draft.names import DitTarget
from patchgen.draft.recognised import Found, Recognised
from patchgen.draft.structure import Module, dotted, nodes
from patchgen.upstream import UpstreamFile

ROTARY_CLASS = re.compile(r"Rot|Rope|PosEmbed", re.IGNORECASE)
TEXT = ("encoder_", "txt_", "text_")  # names of the text stream, which stays whole on every rank
DISPATCH = "dispatch_attention_fn"
WHY = {
    "tokens": "each SP rank runs the blocks on its slice of the tokens and of the RoPE tables; text stays whole",
    "rotary": "this rank's slice of the RoPE tables; the sharded RoPE carries the split to the attention calls",
    "per_token": "per-token timesteps: sliced with the tokens",
    "per_frame": "per-frame conditioning repeated over each frame's tokens: its per-token form sliced with the tokens",
    "mask": "a (tokens x tokens) mask masks queries too: no sharded form of it here",
    "heads": "attention sees every token: all-to-all to this rank's heads (text, when joined, keeps its heads)",
    "sequence": "and back to this rank's tokens x all heads",
    "ring": "under a ring the attention runs ring attention over the ring group (K/V passed around)",
    "gather": "gather the projected tokens and drop the padding before unpatchify",
    "shell": "the trainable class: a transformers PreTrainedModel that loads and saves pure diffusers checkpoints",
}


@dataclass(frozen=True)
class PlanEntry:
    """One leaf of `_cp_plan`: the module (key, '' = the model itself), the input (name or output index) and the
    call (ContextParallelInput / ContextParallelOutput) with its literal keywords."""

    module: str
    item: str | int | None
    kind: str
    kwargs: dict[str, Any]


def cp_plan(mod: Module, cls: str) -> list[PlanEntry] | None:
    """The class's `_cp_plan` literal, flattened; None when it declares none, [] when it is no literal."""
    text = mod.class_attr(cls, "_cp_plan")
    if text is None:
        return None
    out = []
    try:
        for key, value in zip(*_dict_items(ast.parse(text, mode="eval").body), strict=True):
            if isinstance(value, ast.Dict):
                for item, call in zip(*_dict_items(value), strict=True):
                    out.append(PlanEntry(key, item, *_call(call)))
            else:
                out.append(PlanEntry(key, None, *_call(value)))
    except (ValueError, TypeError, AttributeError, AssertionError):  # `**other`, a computed key or value
        return []
    return out


def _dict_items(node: ast.Dict) -> tuple[list[Any], list[ast.AST]]:
    return [ast.literal_eval(k) for k in node.keys], list(node.values)


def _call(node: ast.AST) -> tuple[str, dict[str, Any]]:
    assert isinstance(node, ast.Call)
    return ast.unparse(node.func), {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}


def recognise_dit(target: DitTarget, upstream: UpstreamFile, condition: str) -> Recognised:
    """The DiT kinds in the order the shipped DiT specs list them: shard tokens, RoPE and per-token timesteps; per
    processor the all-to-all pair and the ring; the gather after the output projection; the training shell."""
    mod = Module(upstream)
    out = Recognised(target, upstream)  # type: ignore[arg-type]
    cls = target.cls
    reachable = sorted(reachable_definitions(parsed(upstream.text, upstream.relpath), [cls]))
    plan = cp_plan(mod, cls)
    missing: list[str] = []
    if plan == []:
        state = "states a _cp_plan that is no literal"
        missing.append(f"{cls} ({mod.where(mod.classes[cls])}) {state}, draft reads no token split from it")
    else:
        _forward(mod, cls, plan, reachable, out, missing)
    if missing:  # all SP patches or none
        out.patches = []
        out.unsupported["sp"] = "; ".join(missing)[:300]
    shell = {"cls": cls, "model_type": target.name, "condition_model_type": condition}
    if mod.class_attr(cls, "_no_split_modules") is None:
        blocks = [c for attr, c in mod.built(cls) if "blocks" in attr]
        if not blocks:
            out.unsupported.setdefault("sp", f"{cls} declares no _no_split_modules and builds no *blocks list")
        shell["blocks"] = blocks
    note = f"the diffusers class {cls} at {mod.where(mod.classes[cls])}"
    out.patches.append(Found("dit/training_shell", "<module>", WHY["shell"], note, vars=shell))
    return out


def _text(node: cst.CSTNode, mode: str = "exec") -> str:
    """The canonical one-line text of a statement or expression (comments and layout dropped): an anchor."""
    return normalize(code_of(node).strip() if mode == "eval" else code_of(node), mode) or code_of(node).strip()


def _top(forward: cst.FunctionDef) -> list[cst.CSTNode]:
    return list(forward.body.body)


def _forward(
    mod: Module, cls: str, plan: list[PlanEntry] | None, reachable: list[str], out: Recognised, missing: list[str]
) -> None:
    """The DiT kinds placed by the plan: diffusers' `_cp_plan`, else the one read from the forward's layout."""
    forward = mod.method(cls, "forward")
    if forward is None:
        missing.append(f"{cls} ({mod.where(mod.classes[cls])}) defines no forward")
        return
    body = _top(forward)
    built = dict(mod.built(cls))
    rope = [
        i
        for i, s in enumerate(body)
        if (attr := self_call(assign_of(s)[1])) is not None and _rotary(mod, built.get(attr, ""))
    ]
    if len(rope) != 1:
        missing.append(f"{cls}.forward ({mod.where(forward)}) computes the RoPE tables {len(rope)} times, not once")
        return
    r = rope[0]
    by = "per _cp_plan"
    if plan is None:  # diffusers states none: the plan it would state, read from the forward (dit_layout)
        entries, reason = layout_plan(mod, cls, r)
        if reason:
            missing.append(reason)
            return
        plan, by = [PlanEntry(*e) for e in entries], "as the forward lays them out (no _cp_plan)"
    rotary, call = assign_of(body[r])
    rope_attr = self_call(call)
    embed = next(
        (i for i, s in enumerate(body) if assign_of(s)[0] == "hidden_states" and self_call(assign_of(s)[1])), None
    )
    if embed is None:
        missing.append(f"{cls}.forward ({mod.where(forward)}): no `hidden_states = self.<embedder>(hidden_states)`")
        return
    end = embed
    while end + 1 < len(body) and assign_of(body[end + 1])[0] == "hidden_states":
        end += 1
    if embed > r and init_call(mod, cls, self_call(assign_of(body[embed])[1])) == "nn.Linear":
        where, at = "before", embed  # tokens come in packed: the split runs the token-wise embedder per rank
    else:
        where, at = "after", max(r, end)
    anchor = _text(body[at])
    inputs = [e for e in plan if e.kind == "ContextParallelInput"]
    tokens = ["hidden_states"] + [
        e.item
        for e in inputs
        if isinstance(e.item, str)
        and e.item not in ("hidden_states", "timestep")
        and not e.item.startswith(TEXT)
        and not e.item.endswith(("_ids", "mask"))
        and e.kwargs.get("expected_dims") == 2
    ]
    processors = _processors(mod, reachable)
    if not processors:
        missing.append(f"no processor of {cls} ({mod.where(mod.classes[cls])}) hands {DISPATCH} self._parallel_config")
        return
    dim, prefix = _rotary_dim(body, r, rope_attr, inputs)
    grid = _text(call, "eval") == f"self.{rope_attr}(hidden_states)"  # RoPE tables of the latent grid
    if dim is None and grid and all(_carrier(mod, p) for p, _ in processors):  # each processor takes the tables
        dim = grid_rotary_dim(mod, built.get(rope_attr, ""))
    if dim is None:
        missing.append(f"{cls}.forward: no split of the RoPE tables {by} ({mod.where(body[r])})")
        return
    place = {where: anchor}
    note = f"RoPE `{_text(body[r])}` at {mod.where(body[r])}, tokens split {by}"
    tvars: dict[str, Any] = {"tokens": tokens, "processors": [p for p, _ in processors]}
    out.patches.append(Found("dit/shard_tokens", f"{cls}.forward", WHY["tokens"], note, vars=tvars, **_at(place)))
    rvars: dict[str, Any] = {"rotary": rotary, "dim": dim}
    parts = _rotary_parts(mod, processors)
    if parts is not None:
        rvars["parts"] = parts
    if prefix is not None:
        rvars["prefix"] = prefix
    out.patches.append(Found("dit/shard_rotary", f"{cls}.forward", WHY["rotary"], note, vars=rvars, **_at(place)))
    per_token = [
        (
            f"timestep.ndim == {e.kwargs.get('expected_dims')}",
            f"_cp_plan splits `timestep` of {e.kwargs.get('expected_dims')} dims",
        )
        for e in inputs
        if e.item == "timestep" and e.module == ""
    ]
    for when, reason, note in token_masks(mod, body):
        mvars = {"when": when, "reason": reason}
        out.patches.append(Found("dit/refuse_under_sp", f"{cls}.forward", WHY["mask"], note, vars=mvars, **_at(place)))
    for fvars, before, note in per_frame(mod, body):
        frame = Found("dit/shard_per_token", f"{cls}.forward", WHY["per_frame"], note, before, vars=fvars)
        out.patches.append(dataclasses.replace(frame, place="before"))
    if not per_token and (site := per_token_timestep(body)) is not None:
        note = f"`timestep` embedded flat and its embedding viewed per token at {mod.where(site)}"
        per_token.append(("timestep.ndim > 1 and timestep.shape[1] > 1", note))
    for when, note in per_token:
        pvars = {"tensor": "timestep", "when": when}
        out.patches.append(
            Found("dit/shard_per_token", f"{cls}.forward", WHY["per_token"], note, **_at(place), vars=pvars)
        )
    for name, site in processors:
        _attention(mod, name, site, out)
    gathered = [e.module for e in plan if e.kind == "ContextParallelOutput"]
    sites = [s for s in body if self_call(assign_of(s)[1]) in gathered]
    if len(sites) != 1:
        missing.append(
            f"{cls}.forward ({mod.where(forward)}): the output gathered ({', '.join(gathered)}) is not called once"
        )
        return
    gvars = {"tensor": assign_of(sites[0])[0]}
    note = f"gather the output of `{_text(sites[0])}` at {mod.where(sites[0])}, tokens split {by}"
    out.patches.append(
        Found(
            "dit/gather_tokens",
            f"{cls}.forward",
            WHY["gather"],
            note,
            vars=gvars,
            **_at({"after": _text(sites[0])}),
        )
    )


def _rotary(mod: Module, cls: str) -> bool:
    """A RoPE module: named so (FluxPosEmbed, WanRotaryPosEmbed) or computing its tables with a rotary function
    (BriaEmbedND's forward calls get_1d_rotary_pos_embed)."""
    if ROTARY_CLASS.search(cls):
        return True
    calls = nodes(mod.method(cls, "forward"), lambda n: isinstance(n, cst.Call))
    return cls in mod.classes and any("rotary" in (dotted(c.func) or "") for c in calls)


def _at(place: dict[str, str]) -> dict[str, str]:
    [(where, anchor)] = place.items()
    return {"anchor": anchor, "place": where}


def _processors(mod: Module, reachable: list[str]) -> list[tuple[str, cst.Call]]:
    """(processor, its attention call) for each default processor of the reachable attention modules (`processor=
    X()` or `_default_processor_cls = X`) whose __call__ hands diffusers' parallel config to one dispatch call."""
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
            calls = [c for c in calls if _rotated(mod, name, c)]
        if len(calls) == 1:
            out.append((name, calls[0]))
    return out


def _rotated(mod: Module, processor: str, call: cst.Call) -> bool:
    """Whether the call's key (its second positional argument) is assigned from the processor's RoPE parameter
    (`key = apply_rotary_emb(key, *rotary_emb)`): the self-attention among several parallelised calls."""
    carrier = _carrier(mod, processor)
    args = [a for a in call.args if a.keyword is None]
    key = dotted(args[1].value) if len(args) > 1 else None
    if carrier is None or key is None:
        return False
    return any(
        dotted(node.targets[0].target) == key
        and any(n.value == carrier for n in nodes(node.value, lambda n: isinstance(n, cst.Name)))
        for node in nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Assign))
    )


def _rotary_dim(
    body: list[cst.CSTNode], r: int, rope_attr: str | None, inputs: list[PlanEntry]
) -> tuple[int | None, str | None]:
    """(token dim of the RoPE tables, the expression of the positions before this model's tokens): from the plan's
    split of the RoPE module's outputs, else of the position ids it is called with (`torch.cat((txt_ids, img_ids))`:
    the text positions come first)."""
    own = [e for e in inputs if e.module == rope_attr and isinstance(e.item, int)]
    if own:
        return own[0].kwargs.get("split_dim"), None
    call = assign_of(body[r])[1]
    args = [a for a in call.args if a.keyword is None] if isinstance(call, cst.Call) else []
    if len(args) != 1 or not isinstance(args[0].value, cst.Name):
        return None, None
    source = next((assign_of(s)[1] for s in body[:r] if assign_of(s)[0] == args[0].value.value), None)
    if not (isinstance(source, cst.Call) and dotted(source.func) == "torch.cat" and source.args):
        return None, None
    parts = source.args[0].value
    names = [dotted(e.value) for e in parts.elements] if isinstance(parts, cst.Tuple | cst.List) else []
    split = {e.item: e.kwargs.get("split_dim") for e in inputs if e.module == "" and isinstance(e.item, str)}
    mine = [i for i, n in enumerate(names) if n in split and not n.startswith(TEXT)]
    if len(mine) != 1 or mine[0] > 1:
        return None, None
    prefix = f"{names[0]}.shape[0]" if mine[0] == 1 else None
    return split[names[mine[0]]], prefix


def _rotary_parts(mod: Module, processors: list[tuple[str, cst.Call]]) -> list[int] | None:
    """The parts of a RoPE tuple that belong to the tokens, when a processor unpacks it into named parts of which
    some are the text's (`img_freqs, txt_freqs = image_rotary_emb`); None: every part is per token (cos, sin)."""
    for name, _ in processors:
        carrier = _carrier(mod, name)
        for node in nodes(mod.method(name, "__call__"), lambda n: isinstance(n, cst.Assign)):
            target = node.targets[0].target
            if dotted(node.value) == carrier and isinstance(target, cst.Tuple):
                names = [dotted(e.value) or "" for e in target.elements]
                if any(n.startswith(TEXT) for n in names):
                    return [i for i, n in enumerate(names) if not n.startswith(TEXT)]
    return None


def _carrier(mod: Module, processor: str) -> str | None:
    call = mod.method(processor, "__call__")
    params = [p.name.value for p in call.params.params] if call is not None else []
    rotary = [p for p in params if "rotary" in p]
    return rotary[0] if len(rotary) == 1 else None


def _attention(mod: Module, name: str, call: cst.Call, out: Recognised) -> None:
    """The all-to-all pair around the processor's parallelised attention call, and the ring wrapped around it."""
    scope = f"{name}.__call__"
    statement = next(
        s
        for s in nodes(mod.method(name, "__call__"), lambda n: isinstance(n, cst.SimpleStatementLine))
        if any(n is call for n in nodes(s, lambda n: isinstance(n, cst.Call)))
    )
    tensors = [code_of(a.value) for a in call.args if a.keyword is None][:3]
    first = _cat_of(mod, name, tensors[0])
    replicated = "none" if first is None else "first" if first[0].startswith(TEXT) else "last"
    mask = next((code_of(a.value) for a in call.args if a.keyword and a.keyword.value == "attn_mask"), "None")
    hvars: dict[str, Any] = {"tensors": tensors, "carrier": _carrier(mod, name), "replicated": replicated}
    hvars["dims"] = "bshd"  # dispatch_attention_fn takes (batch, seq, heads, head_dim)
    if mask != "attention_mask":
        hvars["mask"] = mask
    text = _text(statement)
    note = f"{DISPATCH} with diffusers' parallel config at {mod.where(call)}"
    out.patches.append(Found("dit/ulysses_to_heads", scope, WHY["heads"], note, text, vars=hvars, place="before"))
    result = assign_of(statement)[0]
    out.patches.append(
        Found("dit/ulysses_to_sequence", scope, WHY["sequence"], note, text, vars={"tensor": result}, place="after")
    )
    ring = Found("dit/ring_attention", scope, WHY["ring"], note, _text(call, "eval"), vars={"callee": DISPATCH})
    out.patches.append(ring)


def _cat_of(mod: Module, processor: str, name: str) -> list[str] | None:
    """The parts of `name = torch.cat([a, b], dim=1)` in the processor (a joint [text, image] sequence)."""
    for node in nodes(mod.method(processor, "__call__"), lambda n: isinstance(n, cst.Assign)):
        if dotted(node.targets[0].target) == name and isinstance(node.value, cst.Call):
            if dotted(node.value.func) == "torch.cat" and isinstance(node.value.args[0].value, cst.List | cst.Tuple):
                return [dotted(e.value) or "" for e in node.value.args[0].value.elements]
    return None
