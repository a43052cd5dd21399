"""Recognising a transformers decoder LM's structures that the shipped templates serve: the mask builders and
RoPE call of the model forward, every attention call through transformers' attention interface, the LM head and
loss; positions counted elsewhere (lm_positions.py), gated delta-net layers (lm_mixers.py), `_init_weights`
branches transformers would skip (lm_init.py), the load-balancing loss and the stacked experts (lm_moe.py). Each
recognised structure is a patch with the file:line it was found at; a structure not recognised is a
`[model.unsupported]` reason, never a guess."""

from __future__ import annotations

import re

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.cst.prune import parsed, reachable_definitions
from patchgen.draft.lm_init import INIT_WHY, parameterless_inits
from patchgen.draft.lm_mixers import (
    LOCAL_MASK_BUILDERS,
    WHY_CONV,
    WHY_HEADS,
    linear_attention,
    mask_layer_types,
    repeats_heads,
)
from patchgen.draft.lm_moe import moe
from patchgen.draft.lm_positions import (
    WHY_GLOBAL,
    WHY_PASS,
    local_arange,
    other_models,
    rope_form,
    unpassed_position_ids,
)
from patchgen.draft.names import Target
from patchgen.draft.recognised import Found, Recognised
from patchgen.draft.structure import Module, dotted, nodes, parents
from patchgen.upstream import UpstreamFile

# the builders runtime.sp.positions.full_sequence_mask serves (same call signature, a mask over the whole sequence)
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
ATTN_IMPL = "self.config._attn_implementation"
DEFAULT_HIDDEN = "hidden_states[:, slice_indices, :]"
# class names of sequence mixers no template splits over SP (a recurrent state, a convolution along the sequence)
OTHER_MIXERS = re.compile(r"Mamba|GatedDeltaNet|DeltaNet|LinearAttention|ShortConv|Recurrent|RWKV|SSM|Lightning")
WHY = {
    "mask": "Ulysses attention sees the whole sequence, so the causal/packing mask covers all sp * local tokens",
    "rope": "RoPE comes from global position ids; each SP rank keeps the slice for its tokens",
    "attention": "all-to-all to head-sharded full-sequence attention under SP (sp > kv heads repeats KV heads)",
    "loss": "SP: labels shift across ranks and the mean is over the SP group; optional chunked CE without full logits",
}


def recognise(target: Target, upstream: UpstreamFile) -> Recognised:
    """Every structure of the decoder LM the templates know, in the order the shipped specs list them."""
    mod = Module(upstream)
    out = Recognised(target, upstream)
    lm = target.causal_lm
    if lm not in mod.classes:
        out.unsupported["sp"] = f"{lm} is not defined in {upstream.relpath}: draft read nothing to patch"
        return out
    reachable = reachable_definitions(parsed(upstream.text, upstream.relpath), [lm])
    model = next((cls for attr, cls in mod.built(lm) if attr == "model"), None)
    pretrained = next((c for c in reachable if c.endswith("PreTrainedModel") and c in mod.classes), None)
    if model is None or pretrained is None:
        out.unsupported["sp"] = f"{lm}.__init__ builds no `self.model = <decoder>(config)` draft recognises"
        return out
    sp_missing: list[str] = []
    _masks(mod, model, out, sp_missing)
    _rope(mod, model, out, sp_missing)
    sites = _attention(mod, sorted(reachable), pretrained, out, sp_missing, other_models(mod, lm, pretrained))
    _loss_head(mod, lm, out, sp_missing)
    if out.facts.get("linear_mixer"):  # the layer-type names of its layers, for the tiny config
        out.facts["layer_types"] = mask_layer_types(mod, model)
    for layer, anchor, where in unpassed_position_ids(mod, model, sites):
        note = f"{layer}.forward takes position_ids but calls `{anchor}` without them at {where}"
        out.patches.append(Found("sp/attention_position_ids", f"{layer}.forward", WHY_PASS, note, anchor=anchor))
    if out.facts.get("masks_without_positions") and out.data.get("packed_documents"):
        sp_missing.append("mask builders without position ids beside a mixer that reads packed boundaries")
    if out.facts.get("masks_without_positions") and not sp_missing:
        # upstream's mask then lets a packed row's documents attend to each other: the trainer hands it the row's
        # position ids (runtime.sp.positions.documents_from_position_ids) when the record says so
        out.data["packed_documents"] = "position_ids"
    if sp_missing:  # all SP patches or none: a half-patched model would train wrong numbers
        out.patches = []
        out.data.pop("packed_documents", None)  # boundaries only the (dropped) linear-attention patches honour
        out.unsupported["sp"] = "; ".join(sp_missing)[:300]
    moe(mod, lm, model, pretrained, out)
    for cls, where in parameterless_inits(mod, pretrained):
        note = f"{pretrained}._init_weights initialises {cls}, which holds no parameter of its own, at {where}"
        at = next((i for i, p in enumerate(out.patches) if p.template == "moe/ep_plan"), len(out.patches))
        out.patches.insert(at, Found("core/native_weight_init", pretrained, INIT_WHY.format(cls=cls), note))
    return out


def _masks(mod: Module, model: str, out: Recognised, missing: list[str]) -> None:
    forward = mod.method(model, "forward")
    names = nodes(forward, lambda n: isinstance(n, cst.Name) and n.value.startswith("create_") and "mask" in n.value)
    up = parents(forward) if forward is not None else {}
    done: set[int] = set()
    kwargs = _dict_keys(forward)
    for name in names:
        if id(name) in done:
            continue
        if name.value in LOCAL_MASK_BUILDERS:  # a per-token padding mask of the layer's own tokens
            continue
        if name.value not in MASK_BUILDERS:
            missing.append(f"mask builder {name.value} at {mod.where(name)} is not one full_sequence_mask serves")
            continue
        parent = up.get(id(name))
        node: cst.CSTNode = name
        if isinstance(parent, cst.IfExp) and all(
            isinstance(b, cst.Name) and b.value in MASK_BUILDERS for b in (parent.body, parent.orelse)
        ):  # `create_causal_mask if ... else create_sliding_window_causal_mask`: one wrap of the chosen builder
            node = parent
            done.update({id(parent.body), id(parent.orelse)})
        elif sum(1 for n in names if n.value == name.value) != 1:
            missing.append(f"{name.value} is named more than once in {model}.forward ({mod.where(name)})")
            continue
        done.add(id(name))
        anchor = code_of(node)
        found = Found("sp/full_sequence_mask", f"{model}.forward", WHY["mask"], "", anchor=anchor)
        if not _passes_position_ids(forward, kwargs):
            found.vars["position_ids"] = "position_ids"
            found.why = "Ulysses attention sees the whole sequence; the mask builders are called without position ids"
            out.facts["masks_without_positions"] = True
        if any(p.template == found.template and p.vars == found.vars for p in out.patches):
            found.why = "same for sliding-window layers" if "sliding" in anchor else found.why
        found.note = f"mask builder `{anchor}` at {mod.where(node)}"
        out.patches.append(found)
        out.facts.setdefault("masks", []).append(anchor)
    if not names:
        missing.append(f"no mask builder (create_*_mask) in {model}.forward")


def _dict_keys(scope: cst.CSTNode | None) -> dict[str, set[str]]:
    """name -> the string keys of a dict literal assigned to it in `scope` (the builders' `**mask_kwargs`)."""
    out: dict[str, set[str]] = {}
    for node in nodes(scope, lambda n: isinstance(n, cst.Assign) and isinstance(n.value, cst.Dict)):
        keys = {
            e.key.evaluated_value for e in node.value.elements if isinstance(getattr(e, "key", None), cst.SimpleString)
        }
        for target in node.targets:
            if isinstance(target.target, cst.Name):
                out[target.target.value] = keys
    return out


def _passes_position_ids(forward: cst.FunctionDef | None, kwargs: dict[str, set[str]]) -> bool:
    """Whether some mask-builder call of the forward hands over position_ids (a keyword or a `**dict` key)."""
    for call in nodes(forward, lambda n: isinstance(n, cst.Call)):
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "position_ids":
                if "mask" in (dotted(call.func) or ""):
                    return True
            if (
                arg.star == "**"
                and isinstance(arg.value, cst.Name)
                and "position_ids" in kwargs.get(arg.value.value, ())
            ):
                return True
    return False


def _rope(mod: Module, model: str, out: Recognised, missing: list[str]) -> None:
    forward = mod.method(model, "forward")
    calls = nodes(forward, lambda n: isinstance(n, cst.Call) and "rotary" in (dotted(n.func) or "").split(".")[-1])
    texts = [code_of(c) for c in calls]
    for call, text in zip(calls, texts, strict=True):
        if texts.count(text) != 1:
            missing.append(f"RoPE call `{text}` occurs {texts.count(text)} times in {model}.forward")
            continue
        note = f"RoPE (cos, sin) computed once in the model forward: `{text}` at {mod.where(call)}"
        found = Found("sp/rope_slice", f"{model}.forward", WHY["rope"], note, anchor=text)
        form = rope_form(mod, model)
        if form is not None:  # one tensor (complex frequencies), not a (cos, sin) pair
            found.vars["form"] = form[0]
            found.note = note.replace("(cos, sin)", "(one tensor)") + f"; {form[1]}"
        out.patches.append(found)
    if not calls:
        missing.append(f"no RoPE call (self.rotary_emb(...)) in {model}.forward: positions not recognised")


def _attention(
    mod: Module, reachable: list[str], pretrained: str, out: Recognised, missing: list[str], others: dict[str, str]
) -> set[str]:
    """The attention sites (classes) patched; `others`: classes only another model of the module builds."""
    eager = mod.class_attr(pretrained, "_supports_sdpa") == "False"
    sites: set[str] = set()
    for cls in reachable:
        if cls not in mod.classes or cls in others:  # e.g. a VLM's vision attention, named by _init_weights only
            continue
        if OTHER_MIXERS.search(cls):
            _linear_mixer(mod, cls, out, missing)
            continue
        forward = mod.method(cls, "forward")
        uses = nodes(forward, lambda n: isinstance(n, cst.Attribute) and dotted(n) == ATTN_IMPL)
        if len(uses) > 1:
            missing.append(f"{cls}.forward reads {ATTN_IMPL} {len(uses)} times ({mod.where(uses[0])})")
            continue
        if not uses:
            if cls.endswith("Attention") and forward is not None:
                missing.append(f"{cls}.forward ({mod.where(forward)}) attends without transformers' interface")
            continue
        sites.add(cls)
        found = Found("sp/ulysses_attention", f"{cls}.forward", WHY["attention"], "", anchor=ATTN_IMPL)
        found.note = f"attention call through transformers' AttentionInterface ({ATTN_IMPL}) at {mod.where(uses[0])}"
        if eager:
            local = _interface_default(forward)
            if local is None:
                missing.append(f"{cls}.forward: sdpa refused and no eager function passed to the interface")
                continue
            found.vars["local"] = local
            found.why += f"; transformers refuses sdpa for it, so Ulysses wraps the module's own {local}"
            found.note += f"; {pretrained}._supports_sdpa = False: eager"
            out.data["attn_implementation"] = "eager"
        if nodes(mod.classes[cls], lambda n: dotted(n) == "self.sinks"):
            out.facts["sinks"] = True
        out.patches.append(found)
        for anchor, where in local_arange(mod, cls):
            note = f"positions from the layer's own sequence length `{anchor}` at {where}"
            out.patches.append(Found("sp/global_token_positions", f"{cls}.forward", WHY_GLOBAL, note, anchor=anchor))
    if not sites:
        missing.append("no attention call through transformers' AttentionInterface")
    return sites


def _linear_mixer(mod: Module, cls: str, out: Recognised, missing: list[str]) -> None:
    """A gated delta-net the sp/linear_attention kinds split (lm_mixers.py), or the reason it is not one."""
    found, documents, reason = linear_attention(mod, cls) if "DeltaNet" in cls else ([], None, None)
    if not found:
        where = mod.where(mod.classes[cls])
        missing.append(reason or f"sequence mixer {cls} ({where}) is not attention; no SP kind splits it")
        return
    for template, anchor, variables, note in found:
        why = WHY_CONV if template.endswith("conv") else WHY_HEADS
        out.patches.append(Found(template, f"{cls}.forward", why, note, anchor=anchor, vars=variables))
    out.data["packed_documents"] = documents
    out.facts["linear_mixer"] = cls
    out.facts["repeats_heads"] = repeats_heads(mod, cls)


def _interface_default(forward: cst.FunctionDef | None) -> str | None:
    """`eager_attention_forward` of `ALL_ATTENTION_FUNCTIONS.get_interface(<impl>, eager_attention_forward)`."""
    for call in nodes(
        forward, lambda n: isinstance(n, cst.Call) and any(dotted(a.value) == ATTN_IMPL for a in n.args)
    ):
        rest = [a for a in call.args if dotted(a.value) != ATTN_IMPL]
        if len(rest) == 1 and isinstance(rest[0].value, cst.Name):
            return rest[0].value.value
    return None


def _loss_head(mod: Module, lm: str, out: Recognised, missing: list[str]) -> None:
    forward = mod.method(lm, "forward")
    body = list(forward.body.body) if forward is not None else []
    start = next((i for i, s in enumerate(body) if _assigns_lm_head(s)), None)
    end = next((i for i, s in enumerate(body) if _is_labels_if(s)), None) if start is not None else None
    if start is None or end is None or end < start:
        missing.append(f"{lm}.forward: no `logits = self.lm_head(...)` followed by `if labels is not None:`")
        return
    found = Found("loss/causal_lm_head", f"{lm}.forward", WHY["loss"], "", anchor=code_of(body[start]).strip())
    found.through = "if labels is not None:"
    hidden = code_of(body[start].body[0].value.args[0].value)
    if hidden != DEFAULT_HIDDEN:
        found.vars["hidden"] = hidden
    for stmt in body[start + 1 : end]:
        text = code_of(stmt).strip()
        if text == "loss = None":
            continue
        if text.startswith("if self.config.final_logit_softcapping is not None:"):
            found.vars["softcap"] = "self.config.final_logit_softcapping"
            out.handles.append("final_logit_softcapping")
            continue
        missing.append(f"post-processing between logits and loss at {mod.where(stmt)}: `{text.splitlines()[0]}`")
        return
    loss = [code_of(s).strip() for s in body[end].body.body]
    if len(loss) != 1 or not loss[0].startswith("loss = self.loss_function("):
        missing.append(
            f"{lm}.forward: the `if labels is not None:` block at {mod.where(body[end])} is not one loss call"
        )
        return
    call = body[end].body.body[0].body[0].value
    vocab = [a for a in call.args if (a.keyword is not None and a.keyword.value == "vocab_size") or a.keyword is None][
        2:3
    ]
    vocab_text = code_of(vocab[0].value) if vocab else None
    if vocab_text not in (None, "self.config.vocab_size", "self.vocab_size"):
        found.vars["vocab_size"] = vocab_text
    found.note = f"LM head at {mod.where(body[start])} through the loss at {mod.where(body[end])}"
    out.patches.append(found)


def _assigns_lm_head(stmt: cst.CSTNode) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(stmt.body[0], cst.Assign):
        return False
    assign = stmt.body[0]
    return (
        dotted(assign.targets[0].target) == "logits"
        and isinstance(assign.value, cst.Call)
        and dotted(assign.value.func) == "self.lm_head"
        and len(assign.value.args) == 1
    )


def _is_labels_if(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.If) and code_of(stmt.test).strip() == "labels is not None"
