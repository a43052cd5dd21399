"""The start-up self-check's model: the job's own config, shrunk to a few layers and tiny widths, keeping every option
that changes the computation (``runtime/train/self_check.py`` runs it; docs/parallelism.md, "Self-check").

Why a rule rather than the spec's tiny config alone: the tiny config reaches every patched path, but a job sets
options the tiny config does not (a softcap, attention biases, rope scaling, its own layer types): a layout that
breaks one of them must be caught by the proof of that very job. Why not the job's config itself: its sizes cost
what the job costs. The rule, applied key by key (sub-configs such as ``text_config`` recurse):

1. start from the spec's tiny config (``lookup(type).tiny``: internally consistent, reaches every patched path);
2. floats, booleans, strings and lists of strings from the job's config win (``rope_theta``, ``attention_bias``,
   ``final_logit_softcapping``, ``hidden_act``, ``layer_types``...); ``layer_types`` is fitted to the shrunk layer
   count while keeping each distinct type present (the count grows to the number of distinct types if needed);
   dropout probabilities (and router jitter) are set to 0, because the proof compares two runs of random draws
   otherwise (randomness is not what it proves);
3. integer sizes and integer lists come from the tiny config where it has the key; size keys
   (``runtime/train/model_limits.py`` ``size_kind``) and token ids (``*_token_id``, ``*_token_index``) it lacks are
   dropped (the config's defaults apply); other integers of the job are kept; ``max_position_embeddings`` stays the
   job's when its RoPE scaling names an original length (yarn, llama3, longrope scale by the ratio of the two);
4. window sizes (``sliding_window`` and the like) are capped below the proof's documents (the tiny config's value,
   else a quarter of the proof's row) so the window branch is really reached; a window the job turns off (None)
   stays off;
   thresholds go the same way: an integer of the job the tiny config lacks, which the model's code reads from its
   config (``config.<key>``, found in the generated module's source, not listed per model) and which is neither a
   size, a capacity (``max_*``), a layer or expert grouping nor a token id, and any such ``*chunk*`` key (a floor for
   a position-dependent scale, a chunk length) is capped at the same length, so the proof's rows cross it: a layout
   that gives a rank local positions shows only past it (the tiny config's own values are kept: they are its
   author's, consistent with its sizes);
5. expert counts must divide by the job's ``ep``: the tiny config's count if it does, else the smallest multiple of
   ``ep`` at least the top-k; attention heads (and key/value heads) are raised to what the job's Ulysses degree
   splits (the language model's: ``sp / ring``; a vision or audio tower's: ``sp``);
6. keys that describe a checkpoint rather than the computation (``architectures``, ``dtype``, label maps, private
   keys) are left out;
7. a tower (vision, audio) keeps one block, or as many as its block index lists reach (deepstack taps,
   full-attention blocks: every listed block stays, and the blocks before it): its blocks all run the same SP
   sites on hidden states that stay split by the sequence from one block to the next, and each one more costs the
   proof its all-to-alls and FSDP all-gathers in every forward and backward.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.train.model_limits import size_kind

__all__ = [
    "ShrinkLayout",
    "config_reads",
    "crossed_thresholds",
    "fit_layer_types",
    "is_threshold",
    "shrink_values",
    "tower_layers",
]

# What describes the checkpoint, not the computation: never carried into the shrunk config.
META_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "model_type",
        "_name_or_path",
        "name_or_path",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "finetuning_task",
        "task_specific_params",
        "prefix",
    }
)
HEAD_KEYS = ("num_attention_heads", "num_heads", "encoder_attention_heads")
KV_HEAD_KEYS = ("num_key_value_heads",)
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "router_top_k")
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "depth", "encoder_layers")


@dataclass(frozen=True)
class ShrinkLayout:
    """What of the job's layout the shrunk sizes must still fit: its expert-parallel degree, the Ulysses degree the
    (sub-)config's heads are split over, and the proof's row length (windows are capped below it)."""

    ep_size: int = 1
    head_split: int = 1
    row_length: int = 24
    reads: frozenset[str] = frozenset()  # config keys the model's code reads (``config_reads``): thresholds to cross
    tower: bool = False  # a vision or audio tower: its blocks cut to what rule 7 keeps

    @property
    def cap(self) -> int:
        """The length windows and thresholds are capped at: well inside the proof's documents and rows."""
        return max(2, self.row_length // 4)


def is_token_id(name: str) -> bool:
    return name.endswith(("_token_id", "_token_index", "_token_ids"))


def is_window(name: str) -> bool:
    """An attention window size (not a switch or a layer threshold such as ``max_window_layers``)."""
    return "window" in name and size_kind(name) is None and not name.startswith(("use_", "max_window"))


# words of integer keys that count or group things (layers, experts, groups, steps) rather than positions
# ("size" inside a name: Llama 4's intermediate_size_mlp; a chunk length is a threshold whatever its name says)
_NOT_THRESHOLD_WORDS = (
    "layer",
    "group",
    "expert",
    "step",
    "freq",
    "replace",
    "top",
    "seed",
    "vocab",
    "head",
    "dim",
    "size",
)
_READ = re.compile(r"\bconfig\.(\w+)|getattr\(\s*[\w.]*config\s*,\s*[\"'](\w+)[\"']")


def config_reads(source: str) -> frozenset[str]:
    """The config keys a module's code reads (``config.<key>``, ``self.config.<key>``, ``getattr(config, "key")``)."""
    return frozenset(a or b for a, b in _READ.findall(source))


def is_threshold(name: str) -> bool:
    """An integer key that may be a position threshold (a floor, a chunk length): not a size, count or id."""
    if "chunk" in name:
        return True
    if size_kind(name) is not None or is_token_id(name) or name.startswith("max_") or name in TOP_K_KEYS:
        return False  # a size, an id, a capacity (max_position_embeddings, max_source_positions) or a top-k
    return not any(word in name for word in _NOT_THRESHOLD_WORDS)


def crossed_thresholds(job: Mapping[str, Any], shrunk: Mapping[str, Any], layout: ShrinkLayout) -> list[str]:
    """ "key job -> shrunk" for each threshold the shrunk config lowered into the proof's rows (the start-up line)."""
    return [
        f"{name} {job[name]} -> {shrunk[name]}"
        for name in sorted(layout.reads)
        if is_threshold(name) and _is_int(job.get(name)) and _is_int(shrunk.get(name)) and shrunk[name] < job[name]
    ]


def is_expert_count(name: str) -> bool:
    return name.endswith("_experts") and "shared" not in name


def fit_layer_types(types: list[str], layers: int) -> list[str]:
    """``types`` cut to ``layers`` entries, every distinct type kept: the job's own prefix when it holds them all,
    else each distinct type once (first-appearance order), then the job's pattern from its start."""
    distinct = list(dict.fromkeys(types))
    layers = max(layers, len(distinct))
    if set(types[:layers]) == set(distinct):
        return list(types[:layers])
    return distinct + list(types[: layers - len(distinct)])


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _overlay(name: str, job: Any, tiny: Mapping[str, Any], layout: ShrinkLayout) -> tuple[bool, Any]:
    """(keep, value) of key ``name`` whose job value is ``job``: rules 2-4 of the module docstring."""
    if "dropout" in name or "jitter" in name:
        return True, 0.0 if isinstance(job, float) or name in tiny else job
    if is_window(name) and (job is None or _is_int(job)):
        if job is None:
            return True, None
        cap = tiny.get(name) if _is_int(tiny.get(name)) else layout.cap
        return True, min(job, cap)
    if name in layout.reads and name not in tiny and is_threshold(name) and _is_int(job):
        return True, min(job, layout.cap)
    if isinstance(job, bool | float | str) or _is_str_list(job):
        return True, job
    if _is_int(job) or _is_int_list(job) or (job is None and name in tiny):
        if name in tiny:
            return True, tiny[name]
        if size_kind(name) is not None or is_token_id(name) or _is_int_list(job):
            return False, None
        return True, job
    if is_token_id(name):
        return False, None
    return True, job


def tower_layers(config: Mapping[str, Any]) -> int:
    """The blocks a tower keeps (rule 7): one, or one past the last block any index list names."""
    lists = [v for k, v in config.items() if ("index" in k or "indices" in k) and _is_int_list(v) and v]
    return max([1, *(max(v) + 1 for v in lists)])


def _fit_sizes(out: dict[str, Any], layout: ShrinkLayout) -> None:
    """Rule 5: expert counts that ``ep`` divides, heads that the Ulysses degree splits (in place)."""
    top_k = next((out[k] for k in TOP_K_KEYS if _is_int(out.get(k))), 1)
    for name, value in list(out.items()):
        if is_expert_count(name) and _is_int(value) and value % layout.ep_size:
            out[name] = layout.ep_size * math.ceil(max(top_k, 1) / layout.ep_size)
    for name in HEAD_KEYS:
        heads = out.get(name)
        if not _is_int(heads) or heads % layout.head_split == 0:
            continue
        new = layout.head_split * math.ceil(heads / layout.head_split)
        out[name] = new
        if "head_dim" not in out and _is_int(out.get("hidden_size")):
            out["hidden_size"] = new * max(1, out["hidden_size"] // heads)
    heads = next((out[k] for k in HEAD_KEYS if _is_int(out.get(k))), None)
    for name in KV_HEAD_KEYS:
        kv = out.get(name)
        if heads is not None and _is_int(kv) and heads % kv:
            out[name] = heads


def shrink_values(
    job: Mapping[str, Any],
    tiny: Mapping[str, Any],
    layout: ShrinkLayout,
    sub_layouts: Mapping[str, ShrinkLayout] | None = None,
    sub_configs: Collection[str] = (),
) -> dict[str, Any]:
    """The shrunk config (plain data) of the job's config ``job`` (``config.to_dict()``) on the spec's ``tiny``
    config, by the module docstring's rule. ``sub_configs`` names the keys holding sub-configs (a VLM's
    ``text_config``...), shrunk recursively under ``sub_layouts[key]`` (default: ``layout``)."""
    out: dict[str, Any] = {k: v for k, v in tiny.items() if k not in job or k in sub_configs}
    for name, value in job.items():
        if name in META_KEYS or name.startswith("_"):
            continue
        if isinstance(value, Mapping) and (name in sub_configs or isinstance(tiny.get(name), Mapping)):
            sub_tiny = tiny.get(name) if isinstance(tiny.get(name), Mapping) else {}
            sub = (sub_layouts or {}).get(name, layout)
            out[name] = shrink_values(value, sub_tiny, sub, None, ())
            continue
        keep, shrunk = _overlay(name, value, tiny, layout)
        if keep:
            out[name] = shrunk
    rope = out.get("rope_parameters") or out.get("rope_scaling")
    if isinstance(rope, Mapping) and "original_max_position_embeddings" in rope:
        if _is_int(job.get("max_position_embeddings")):
            out["max_position_embeddings"] = job["max_position_embeddings"]
    layers = next((k for k in LAYER_COUNT_KEYS if _is_int(out.get(k))), None)
    if layers is not None and _is_str_list(out.get("layer_types")):
        out["layer_types"] = fit_layer_types(out["layer_types"], out[layers])
        out[layers] = len(out["layer_types"])
    elif layers is not None and layout.tower:
        out[layers] = min(out[layers], tower_layers(out))
    _fit_sizes(out, layout)
    return out
