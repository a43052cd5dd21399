"""The tiny config of a drafted decoder LM, by one documented rule (the installed transformers ships no test files, so
there is no upstream test config to copy): the project's tiny base, then one value per config field the model
declares that gates a structure, chosen so every patched path runs and sp = 2 and 4 divide the heads.

Rule (docs/adding-a-model.md, `patchgen draft`): vocab 97, hidden 64, intermediate 96, 2 layers, 4 heads, 2 KV
heads, head_dim 16, 128 positions, untied, no cache; sliding windows of 6 tokens on one layer of two (or, where the
builder is chosen for the whole model, in a `sliding` variant); MoE: 8 experts, top-2, expert width 32 (48 shared),
every layer sparse unless the model has a leading dense layer (then one), 2 expert groups, a routed scale of 1.5,
the load-balancing loss on at 0.01; partial rotary at the config's own default where it sets one, else 0.5; a
gated delta-net on layer 0 (softmax attention on layer 1) with 2 key and 4 value heads of 8, kernel 4, and a
`no_repeat` variant of 4 and 4; value heads of 8; latent attention (MLA) with RoPE and
no-RoPE query/key parts of 8, KV / query ranks of 32 / 48 and a KV head per head; a padding id outside the
vocabulary becomes 0; a boolean `use_*` field a patched scope branches on gets a variant that turns it on.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.draft.recognised import Recognised
from patchgen.draft.structure import Module, dotted, nodes, walk

BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "use_cache": False,
}
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
MOE_VALUES: dict[str, Any] = {
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "n_shared_experts": 1,
    "decoder_sparse_step": 1,
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense", "sparse"],
    "n_group": 2,
    "topk_group": 2,
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
}
WINDOW = 6
# the load-balancing loss on, where the config declares the flag (a forward reading it from its kwargs gets it from
# the trainer: runtime.train.text_step)
AUX_VALUES: dict[str, Any] = {"output_router_logits": True, "router_aux_loss_coef": 0.01}
# a gated delta-net: value heads 4 (sp = 2 and 4 divide them and the conv channels), key heads 2 (q and k repeated)
LINEAR_VALUES: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
PARTIAL_DEFAULT = re.compile(r"""setdefault\(\s*["']partial_rotary_factor["']\s*,\s*([0-9.]+)\s*\)""")
MLA_VALUES: dict[str, Any] = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 48}


def config_fields(text: str, model_type: str) -> dict[str, Any]:
    """field -> default of the config class declaring `model_type = "<model_type>"` (a dataclass-style class body;
    a default that is no literal reads as None)."""
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        own = [s for s in node.body if isinstance(s, ast.Assign) and ast.unparse(s).startswith("model_type = ")]
        if own and ast.literal_eval(own[0].value) == model_type:
            return {s.target.id: _literal(s.value) for s in node.body if isinstance(s, ast.AnnAssign)}
    return {}


def _literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def tiny_config(found: Recognised, mod: Module, fields: dict[str, Any], config_text: str):
    """(tiny, variants, capabilities, notes): the rule above applied to what `found` recognised."""
    tiny = dict(BASE)
    variants: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    capabilities: list[str] = []
    masks = found.facts.get("masks", [])
    if found.facts.get("moe"):
        capabilities.append("moe")
        count = next((k for k in EXPERT_COUNTS if k in fields), None)
        if count is not None:
            tiny[count] = 8
        tiny.update({k: v for k, v in MOE_VALUES.items() if k in fields or k == "num_experts_per_tok"})
        if "moe_intermediate_size" not in fields:
            tiny["intermediate_size"] = 32  # the experts' width is intermediate_size
        if found.facts.get("aux_loss"):
            tiny.update({k: v for k, v in AUX_VALUES.items() if k in fields})
        notes.append(f"8 experts, top-2{', a load-balancing loss' if found.facts.get('aux_loss') else ''}")
    chosen = [m for m in masks if " if " in m]
    if chosen:  # one builder for the whole model, chosen by the config: the other one in a variant
        variants["sliding"] = {"use_sliding_window": True} if "use_sliding_window" in fields else {}
        variants["sliding"]["sliding_window"] = WINDOW
        notes.append(f"every layer on a sliding window of {WINDOW} tokens in the `sliding` variant")
    elif any("sliding" in m for m in masks):
        capabilities.append("sliding_window")
        if "use_sliding_window" in fields and "max_window_layers" in fields:
            tiny.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        else:
            tiny.update(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
        notes.append(f"one layer of two on a sliding window of {WINDOW} tokens")
        if _gated(mod, found, "sliding"):
            variants["full"] = (
                {"use_sliding_window": False}
                if "use_sliding_window" in tiny
                else {"layer_types": ["full_attention"] * 2}
            )
    if "v_head_dim" in fields:
        tiny["v_head_dim"] = 8
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: the config derives head_dim from these
        del tiny["head_dim"]
        tiny["num_key_value_heads"] = tiny["num_attention_heads"]  # keys and values decompress to every head
        tiny.update({k: v for k, v in MLA_VALUES.items() if k in fields})
    pad = fields.get("pad_token_id")
    if isinstance(pad, int) and pad >= tiny["vocab_size"]:  # the embedding's padding row must exist
        tiny["pad_token_id"] = 0
    if 'rope_parameters.get("partial_rotary_factor"' in mod.upstream.text:
        tiny["partial_rotary_factor"] = _partial_factor(config_text)
    _linear(found, fields, tiny, variants, notes)
    if "rope_parameters[layer_type]" in mod.upstream.text and "layer_types" in tiny:
        factor = {"partial_rotary_factor": 0.5} if "partial_rotary_factor" in mod.upstream.text else {}
        tiny["rope_parameters"] = {
            t: {"rope_type": "default", "rope_theta": 10000.0, **factor} for t in tiny["layer_types"]
        }
    elif '"rope_type": "yarn"' in config_text:  # a scaled default RoPE needs more positions than a tiny model has
        tiny["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    for name in _bool_gates(mod, found, fields):
        variants[name.removeprefix("use_")] = {name: True}
    for name in found.handles:
        tiny[name] = 30.0
    return tiny, variants, capabilities, notes


def _patched_scopes(mod: Module, found: Recognised) -> list[cst.CSTNode]:
    out = []
    for patch in found.patches:
        cls, _, method = patch.scope.partition(".")
        node = mod.method(cls, method) if method else None
        if node is not None:
            out.append(node)
    return out


def _gated(mod: Module, found: Recognised, word: str) -> bool:
    """Whether a patched scope branches on a test that names `word` (e.g. `if self.has_sliding_layers:`)."""
    return any(
        word in code_of(n.test) for s in _patched_scopes(mod, found) for n in nodes(s, lambda n: isinstance(n, cst.If))
    )


def _bool_gates(mod: Module, found: Recognised, fields: dict[str, Any]) -> list[str]:
    """Boolean config fields, off by default, that an `if` of a patched scope tests (`self.config.use_x`, or
    `self.use_x` set from the config in `__init__`)."""
    out: list[str] = []
    for scope in _patched_scopes(mod, found):
        for node in nodes(scope, lambda n: isinstance(n, cst.If | cst.IfExp)):
            for part in walk(node.test):
                name = (dotted(part) or "").removeprefix("self.config.").removeprefix("self.")
                if isinstance(part, cst.Attribute) and fields.get(name, None) is False and name.startswith("use_"):
                    if name not in out:
                        out.append(name)
    return out


def _partial_factor(config_text: str) -> float:
    """The config's own default partial rotary factor (`kwargs.setdefault("partial_rotary_factor", 0.25)`) where
    it leaves the tiny head dim an even rotary width, else 0.5."""
    match = PARTIAL_DEFAULT.search(config_text)
    factor = float(match.group(1)) if match else 0.5
    rotary = BASE["head_dim"] * factor
    return factor if 0 < factor < 1 and rotary == int(rotary) and int(rotary) % 2 == 0 else 0.5


def _linear(found: Recognised, fields: dict[str, Any], tiny: dict[str, Any], variants: dict, notes: list[str]) -> None:
    """A gated delta-net (lm_mixers.py): the first layer linear attention, the second softmax attention; q and k
    repeated per value head, and a `no_repeat` variant with one value head per key head where the mixer branches."""
    if not found.facts.get("linear_mixer"):
        return
    kinds = found.facts.get("layer_types", {})
    linear, full = kinds.get("create_recurrent_attention_mask"), kinds.get("create_causal_mask")
    if "layer_types" in fields and linear and full:
        tiny["layer_types"] = [linear, full]
    tiny.update({k: v for k, v in LINEAR_VALUES.items() if k in fields})
    notes.append("layer 0 linear attention (2 key heads, 4 value heads), layer 1 softmax attention")
    heads = ("linear_num_key_heads", "linear_num_value_heads")
    if found.facts.get("repeats_heads") and all(h in fields for h in heads):
        variants["no_repeat"] = dict.fromkeys(heads, LINEAR_VALUES["linear_num_value_heads"])
