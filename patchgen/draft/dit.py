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

from patchgen.cst.prune import parsed, reachable_definitions
from patchgen.draft.dit_frames import per_frame, token_masks
from patchgen.draft.dit_joint import joint_sequence
from patchgen.draft.dit_layout import (
    assign_of,
    canonical,
    gather_found,
    grid_rotary_dim,
    init_call,
    layout_plan,
    per_token_timestep,
    self_call,
)
from patchgen.draft.dit_processors import DISPATCH, TEXT, attention, default_processors, rotary_param, rotary_parts
from patchgen.draft.dit_residuals import residual_refusals
from patchgen.draft.dit_rope_tables import flat_rotary_dim
from patchgen.draft.dit_shared import shared_attention
from patchgen.draft.dit_text import text_refiners
from patchgen.draft.dit_token_index import global_token_counts
from patchgen.draft.names import DitTarget
from patchgen.draft.recognised import Found, Recognised
from patchgen.draft.structure import Module, dotted, nodes
from patchgen.upstream import UpstreamFile, UpstreamSource

ROTARY_CLASS = re.compile(r"Rot|Rope|PosEmbed", re.IGNORECASE)
WHY = {
    "tokens": "each SP rank runs the blocks on its slice of the tokens and of the RoPE tables; text stays whole",
    "rotary": "this rank's slice of the RoPE tables; the sharded RoPE carries the split to the attention calls",
    "per_token": "per-token timesteps: sliced with the tokens",
    "per_frame": "per-frame conditioning repeated over each frame's tokens: its per-token form sliced with the tokens",
    "mask": "a (tokens x tokens) mask masks queries too: no sharded form of it here",
    "index": "these blocks index tokens by their position in the whole sequence: refused under SP",
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


def recognise_dit(
    target: DitTarget, upstream: UpstreamFile, condition: str, source: UpstreamSource | None = None
) -> Recognised:
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
    elif source is None or not shared_attention(mod, cls, source, out, missing):  # processors of shared modules
        _forward(mod, cls, plan, reachable, out, missing)
    if missing:  # all SP patches or none
        out.patches = []
        out.unsupported["sp"] = "; ".join(missing)[:300]
    else:  # refused first: before the forward's first statement
        out.patches[:0] = residual_refusals(mod, cls)
    shell = {"cls": cls, "model_type": target.name, "condition_model_type": condition}
    if mod.class_attr(cls, "_no_split_modules") is None:
        blocks = [c for attr, c in mod.built(cls) if "blocks" in attr]
        if not blocks:
            out.unsupported.setdefault("sp", f"{cls} declares no _no_split_modules and builds no *blocks list")
        shell["blocks"] = blocks
    note = f"the diffusers class {cls} at {mod.where(mod.classes[cls])}"
    out.patches.append(Found("dit/training_shell", "<module>", WHY["shell"], note, vars=shell))
    return out


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
    joint = joint_sequence(mod, cls, body, lambda c: _rotary(mod, c)) if not rope else None  # Lumina2
    rope = [joint.rope] if joint is not None else rope
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
    rotary, call = (joint.rotary, joint.call) if joint is not None else assign_of(body[r])
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
    processors = default_processors(mod, reachable)
    end, refiners = text_refiners(mod, cls, body, end, [p for p, _ in processors])  # run before the split
    if joint is not None:
        where, at = "after", joint.split  # the joint [text, image] sequence, right before the main blocks
    elif embed > r and init_call(mod, cls, self_call(assign_of(body[embed])[1])) == "nn.Linear":
        where, at = "before", embed  # tokens come in packed: the split runs the token-wise embedder per rank
    else:
        where, at = "after", max(r, end)
    anchor = canonical(body[at])
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
    tokens += joint.tokens if joint is not None else []  # the key mask of the joint sequence
    if not processors:
        missing.append(f"no processor of {cls} ({mod.where(mod.classes[cls])}) hands {DISPATCH} self._parallel_config")
        return
    dim, prefix = (joint.dim, None) if joint is not None else _rotary_dim(body, r, rope_attr, inputs)
    grid = canonical(call, "eval") == f"self.{rope_attr}(hidden_states)"  # RoPE tables of the latent grid
    if dim is None and grid and all(rotary_param(mod, p) for p, _ in processors):  # each processor takes the tables
        tables = (grid_rotary_dim(mod, built.get(rope_attr, "")), flat_rotary_dim(mod, built.get(rope_attr, "")))
        dim = next((d for d in tables if d is not None), None)
    if dim is None:
        missing.append(f"{cls}.forward: no split of the RoPE tables {by} ({mod.where(body[r])})")
        return
    place = {where: anchor}
    note = f"RoPE `{canonical(body[r])}` at {mod.where(body[r])}, tokens split {by}"
    tvars: dict[str, Any] = {"tokens": tokens, "processors": [p for p, _ in processors]}
    if refiners:
        tvars["replicated_modules"] = refiners
    for rvars, after, rnote in global_token_counts(mod, cls, body):  # before the split in the forward: first
        refusal = Found("dit/refuse_under_sp", f"{cls}.forward", WHY["index"], rnote, after, vars=rvars)
        out.patches.append(dataclasses.replace(refusal, place="after"))
    out.patches.append(Found("dit/shard_tokens", f"{cls}.forward", WHY["tokens"], note, vars=tvars, **_at(place)))
    rvars: dict[str, Any] = {"rotary": rotary, "dim": dim}
    parts = rotary_parts(mod, processors)
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
        attention(mod, name, site, out)
    gathered = [e.module for e in plan if e.kind == "ContextParallelOutput"]
    sites = [s for s in body if self_call(assign_of(s)[1]) in gathered]
    if len(sites) != 1:
        missing.append(
            f"{cls}.forward ({mod.where(forward)}): the output gathered ({', '.join(gathered)}) is not called once"
        )
        return
    note = f"gather the output of `{canonical(sites[0])}` at {mod.where(sites[0])}, tokens split {by}"
    out.patches.append(gather_found(f"{cls}.forward", assign_of(sites[0])[0], canonical(sites[0]), note))


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
