"""Recognising a linear-attention sequence mixer the SP kinds split (a gated delta-net: Qwen3-Next): a short causal
depthwise convolution over the projected q/k/v channels (`sp/linear_attention_conv`) and a chunked gated delta-rule
recurrence over the value heads (`sp/linear_attention_heads`), both run over the whole sequence by
runtime/sp/linear_attention.py. Anything else in such a class (another fused convolution, a recurrence called
otherwise) is a reason, never a guess."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.structure import Module, dotted, nodes, parents

WHY_CONV = (
    "the short causal convolution runs over the whole sequence on this rank's channels; restarts at packed documents"
)
WHY_HEADS = (
    "the gated delta rule runs over the whole sequence on this rank's value heads; restarts at packed documents"
)
# the padding mask builder of linear-attention layers: a per-token mask of the tokens the layer holds (None on an
# unpadded row, transformers.masking_utils), no mask between tokens: nothing to build over the whole sequence
LOCAL_MASK_BUILDERS = ("create_recurrent_attention_mask",)
# the fused convolution runtime/sp/linear_attention.py refuses under SP by this attribute name, and the cached
# decode's per-step update (a recurrent state the SP kinds refuse): neither runs in an SP training step
FUSED_CONV = "self.causal_conv1d_fn"
DECODE_CONV = "self.causal_conv1d_update"
DOCUMENTS = 'kwargs.get("cu_seq_lens_q")'


def linear_attention(mod: Module, cls: str) -> tuple[list[tuple[str, str, dict, str]], str | None, str | None]:
    """([(template, anchor, vars, note)], packed-documents data or None, reason or None) for the mixer `cls`."""
    where = mod.where(mod.classes[cls])
    forward = mod.method(cls, "forward")
    if forward is None:
        return [], None, f"sequence mixer {cls} ({where}) has no forward"
    conv = _depthwise_conv(mod, cls)
    if conv is None:
        return [], None, f"sequence mixer {cls} ({where}) builds no causal depthwise nn.Conv1d (padding kernel - 1)"
    calls = nodes(forward, lambda n: isinstance(n, cst.Call) and _self_call(n) and "conv" in dotted(n.func))
    own = [c for c in calls if dotted(c.func) == conv]
    other = sorted(
        {dotted(c.func) for c in calls}
        - {conv, FUSED_CONV, DECODE_CONV}
        - {d for d in map(dotted, (c.func for c in calls)) if d.startswith(f"{conv}.")}
    )
    if len(own) != 1 or other:
        what = f"calls {', '.join(other)}" if other else f"calls {conv} {len(own)} times"
        return [], None, f"sequence mixer {cls}.forward ({mod.where(forward)}) {what}: no SP kind splits it"
    call = own[0]
    parent = parents(forward).get(id(call))
    arg = code_of(call.args[0].value) if len(call.args) == 1 and call.args[0].keyword is None else None
    kept = f"[:, :, : {arg}.shape[-1]]"
    if arg is None or not isinstance(parent, cst.Subscript) or not code_of(parent).endswith(kept):
        return [], None, f"{conv}(...) at {mod.where(call)} is not kept to its input's length `{kept}`"
    rules = [
        c
        for c in nodes(forward, lambda n: isinstance(n, cst.Call) and _self_call(n))
        if {"g", "beta", "cu_seqlens"} <= {a.keyword.value for a in c.args if a.keyword is not None}
    ]
    if len(rules) != 1 or len([a for a in rules[0].args if a.keyword is None]) != 3:
        return (
            [],
            None,
            f"sequence mixer {cls} ({where}): no one gated delta-rule call (q, k, v, g=, beta=, cu_seqlens=)",
        )
    rule = rules[0]
    kernel = dotted(rule.func)
    documents = next(code_of(a.value) for a in rule.args if a.keyword is not None and a.keyword.value == "cu_seqlens")
    found = [
        ("sp/linear_attention_conv", code_of(call), {"conv": conv}, f"causal depthwise {conv} at {mod.where(call)}"),
        (
            "sp/linear_attention_heads",
            kernel,
            {},
            f"gated delta rule {kernel}(q, k, v, g=, beta=) at {mod.where(rule)}",
        ),
    ]
    data = "cu_seq_lens" if documents == DOCUMENTS else None  # the trainer hands the row's boundaries to the mixer
    if data is None:
        return [], None, f"{kernel} at {mod.where(rule)} reads packed documents from `{documents}`, not {DOCUMENTS}"
    return found, data, None


def _self_call(call: cst.Call) -> bool:
    return (dotted(call.func) or "").startswith("self.")


def _depthwise_conv(mod: Module, cls: str) -> str | None:
    """`self.<attr>` of an `nn.Conv1d(...)` built in `cls.__init__` with groups = in_channels and padding
    kernel_size - 1: causal once the caller keeps the first L outputs."""
    for node in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.Assign)):
        if not isinstance(node.value, cst.Call) or dotted(node.value.func) not in ("nn.Conv1d", "torch.nn.Conv1d"):
            continue
        kw = {a.keyword.value: code_of(a.value) for a in node.value.args if a.keyword is not None}
        if (
            kw.get("groups") is not None
            and kw.get("groups") == kw.get("in_channels")
            and kw.get("padding") == (f"{kw.get('kernel_size')} - 1")
        ):
            return dotted(node.targets[0].target)
    return None


def mask_layer_types(mod: Module, model: str) -> dict[str, str]:
    """builder -> layer type, from the forward's `{"full_attention": create_causal_mask(...), ...}` mapping: the
    names the config's `layer_types` takes for each kind of layer."""
    out: dict[str, str] = {}
    for node in nodes(mod.method(model, "forward"), lambda n: isinstance(n, cst.Dict)):
        for element in node.elements:
            key, value = getattr(element, "key", None), element.value
            if isinstance(key, cst.SimpleString) and isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
                out[value.func.value] = key.evaluated_value
    return out


def repeats_heads(mod: Module, cls: str) -> bool:
    """Whether `cls.forward` branches on a ratio of its head counts (`if self.num_v_heads // self.num_k_heads > 1:`
    repeats q and k per value head): the tiny config takes the branch, a variant the other way."""
    tests = [code_of(n.test) for n in nodes(mod.method(cls, "forward"), lambda n: isinstance(n, cst.If))]
    return any("//" in t and "heads" in t for t in tests)
