"""A spec's `[model]` table: what the runtime needs to know about the model a spec generates.

The spec is the single source of a model. Its `[model]` table says which generated class trains it, how the upstream
reference is built, which family of trainer and test suites it belongs to, what it can do (capabilities), a tiny
random config that runs every patched path, and family-specific data. `patchgen regen` writes it next to the
generated module as `<output>.model.json`; the runtime registry and the tests read only that file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from patchgen.errors import PatchgenError
from patchgen.varkinds import is_dotted, is_identifier, type_name

FAMILIES = ("causal_lm", "vlm", "omni", "dit")
CAPABILITIES = (
    "moe",  # sparse experts: EP plan, router aux loss
    "vision",  # an image encoder
    "video",  # video inputs
    "audio",  # an audio encoder
    "deepstack",  # visual features injected into several LM layers
    "window_attention",  # windowed ViT attention (Qwen2.5-VL)
    "sliding_window",  # sliding-window LM attention layers
    "guidance",  # DiT: guidance embedding (Flux-dev style)
    "image_condition",  # DiT: an image-conditioned variant (Wan I2V)
)
MODEL_KEYS = {
    "model_type": "identifier",
    "class": "identifier",
    "upstream": "dotted",
    "family": "word",
    "capabilities": "list",
    "tiny": "table",
    "data": "table",
    "conversions": "bool",
    "handles": "handles",
    "unsupported": "unsupported",
}
# Config options a spec may declare its patched code honours (`handles`): the runtime refuses a config that sets one
# of these to a value that changes the computation unless the model's record lists it.
HANDLES = ("final_logit_softcapping",)
REQUIRED_MODEL_KEYS = ("model_type", "class", "upstream", "family")
# The patch kinds the record's `supports` is derived from (never declared by hand: the patches are the proof).
SP_KINDS = ("sp/ulysses_attention", "dit/shard_tokens")
LM_RING_KIND = "sp/ulysses_attention"  # the LM Ulysses wrapper runs ring attention itself
# a DiT attention site exact on a ring without a ring wrapper: linear attention's key-value sums are all-reduced over
# the whole SP group, and a cross-attention to replicated text needs no other rank's keys
RING_EXACT_SITE_KINDS = ("dit/linear_attention_kv", "dit/local_attention")
EP_KINDS = ("moe/ep_plan",)
RING_KIND = "dit/ring_attention"
# `[model.unsupported]`: a capability the class lacks -> the one-line reason the runtime and the test suites quote
UNSUPPORTED_CAPABILITIES = ("sp", "ring", "ep")
MAX_REASON_CHARS = 300
ATTENTION_SITE_KINDS = (
    "sp/ulysses_attention",
    "sp/vit_attention_all_to_all",
    "dit/ulysses_to_heads",
    "dit/linear_attention_kv",
    "dit/local_attention",
)
SIDECAR_SUFFIX = ".model.json"
# `tiny` and `data` are plain data the runtime builds models and data pipelines from: bounded, so a spec cannot make
# a test or a demo allocate a huge model or loop for ever. `data.tiny_variants.<name>` tables are tiny configs too.
MAX_TINY_INT = 8192  # any integer of a tiny config (sizes, counts, token ids, positions)
MAX_TINY_FLOAT = 1e7  # any float of a tiny config (e.g. rope_theta)
MAX_DATA_NUMBER = 1 << 31  # the magnitude of any other number in `data`
MAX_TABLE_DEPTH = 4  # tables nested in `tiny` / `data`, these included ([model.tiny.text_config.rope_parameters])
MAX_TABLE_KEYS = 256
MAX_ARRAY_ITEMS = 256
MAX_STRING_CHARS = 200
_DATA_STRING = re.compile(r"[A-Za-z0-9_.+-]*")  # names, dotted class paths, words such as "default"
_COUNT_KEY = re.compile(r"num_\w+|\w+_(size|dim|layers|heads)|depth")  # an integer, or an array of integers


@dataclass(frozen=True)
class ModelTable:
    model_type: str
    cls: str  # `class` in the spec
    upstream: str  # e.g. transformers.AutoModelForCausalLM or diffusers.WanTransformer3DModel
    family: str
    capabilities: tuple[str, ...] = ()
    tiny: dict[str, Any] = field(default_factory=dict, hash=False)
    data: dict[str, Any] = field(default_factory=dict, hash=False)
    conversions: bool = True  # a transformers model shares upstream's checkpoint-layout conversions (implied patch)
    handles: tuple[str, ...] = ()  # config options the patched code honours (HANDLES)
    unsupported: dict[str, str] = field(default_factory=dict, hash=False)  # capability -> why the class lacks it

    @property
    def implies_conversions(self) -> bool:
        """Whether the spec gets the implied `core/upstream_weight_conversions` patch: every transformers model
        loads every checkpoint layout its upstream class accepts (legacy key names, per-expert MoE files)."""
        return self.conversions and self.upstream.startswith("transformers.")

    def to_json(
        self,
        spec_name: str,
        output: str,
        companions: list[str] | tuple[str, ...] = (),
        supports: dict[str, Any] | None = None,
    ) -> str:
        """The sidecar's text: deterministic (sorted keys), importable module path included, the importable paths of
        the spec's companion modules when it has any, and what its patches support (`derive_supports`)."""
        record = {
            "spec": spec_name,
            "module": module_of(output),
            "model_type": self.model_type,
            "class": self.cls,
            "upstream": self.upstream,
            "family": self.family,
            "capabilities": list(self.capabilities),
            "tiny": self.tiny,
            "data": self.data,
            "supports": supports if supports is not None else derive_supports((), self.handles, self.unsupported),
        }
        if companions:
            record["companions"] = list(companions)
        return json.dumps(record, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


def derive_supports(
    patches: Iterable[tuple[str, str, dict[str, Any]]],
    handles: Iterable[str] = (),
    unsupported: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The record's `supports`, derived from the spec's applied patches ((template, scope, vars with defaults) each)
    so that the runtime can refuse a layout the generated code was never patched for: sp (a Ulysses attention or a
    DiT token split), ring (the LM Ulysses wrapper, or a DiT whose every head-sharded attention site is wrapped by
    dit/ring_attention, the other sites exact on a ring), ep (an EP plan), the scopes of the
    attention sites, the module paths a DiT keeps replicated, and the config options the spec declares handled;
    `unsupported` (only when the spec states one): why the class lacks a capability (`[model.unsupported]`)."""
    patches = list(patches)
    kinds = {template for template, _, _ in patches}
    replicated = {
        str(name)
        for template, _, values in patches
        if template == "dit/shard_tokens"
        for name in values.get("replicated_modules", [])
    }
    to_heads = {scope for template, scope, _ in patches if template == "dit/ulysses_to_heads"}
    ringed = {scope for template, scope, _ in patches if template == "dit/ring_attention"}
    exact = {scope for template, scope, _ in patches if template in RING_EXACT_SITE_KINDS}
    record = {
        "sp": any(kind in kinds for kind in SP_KINDS),
        # a DiT runs on a ring when every all-to-all attention site is wrapped by dit/ring_attention
        "ring": LM_RING_KIND in kinds or (bool(to_heads | exact) and to_heads <= ringed),
        "ep": any(kind in kinds for kind in EP_KINDS),
        "attention_sites": sorted({scope for template, scope, _ in patches if template in ATTENTION_SITE_KINDS}),
        "replicated_modules": sorted(replicated),
        "handles": sorted(set(handles)),
    }
    if unsupported:
        record["unsupported"] = dict(sorted(unsupported.items()))
    return record


def check_unsupported(model: ModelTable, patches: Iterable[tuple[str, str, dict[str, Any]]], where: str) -> None:
    """A `[model.unsupported]` reason stated for a capability the spec's patches provide is a contradiction."""
    patches = list(patches)
    derived = derive_supports(patches)
    kinds = {template for template, _, _ in patches}
    providers = {
        "sp": SP_KINDS,
        "ring": (LM_RING_KIND, RING_KIND, *RING_EXACT_SITE_KINDS),
        "ep": EP_KINDS,
    }
    for capability in model.unsupported:
        if derived[capability]:
            given = ", ".join(sorted(kinds & set(providers[capability])))
            raise PatchgenError(
                f"{where}: [model.unsupported] key {capability!r} says the class lacks {capability}, but its patches "
                f"provide it ({given}); remove the key, or the patches"
            )


def module_of(output: str) -> str:
    """`generated/qwen3/modeling_qwen3.py` -> `generated.qwen3.modeling_qwen3` (outputs are package members)."""
    return ".".join(PurePosixPath(output).with_suffix("").parts)


def sidecar_path(output: str) -> str:
    return str(PurePosixPath(output).with_suffix("")) + SIDECAR_SUFFIX


def merge_tables(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, recursively for nested tables (an `extends` spec changes only what it names)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            merge_tables(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def parse_model_table(table: Any, where: str) -> ModelTable:
    """Validate a `[model]` table; every error names the file and key."""
    if not isinstance(table, dict):
        raise PatchgenError(f"{where}: [model] must be a table")
    for key in REQUIRED_MODEL_KEYS:
        if key not in table:
            raise PatchgenError(f"{where}: [model] is missing {key!r} ({MODEL_KEYS[key]})")
    for key, value in table.items():
        kind = MODEL_KEYS.get(key)
        if kind is None:
            raise PatchgenError(f"{where}: [model] has unknown key {key!r}; expected one of {sorted(MODEL_KEYS)}")
        if kind == "unsupported":
            _check_unsupported_table(where, value)
            continue
        ok = {
            "identifier": lambda v: isinstance(v, str) and is_identifier(v),
            "dotted": lambda v: isinstance(v, str) and is_dotted(v) and "." in v,
            "word": lambda v: v in FAMILIES,
            "list": lambda v: isinstance(v, list) and all(c in CAPABILITIES for c in v) and len(set(v)) == len(v),
            "table": lambda v: isinstance(v, dict),
            "bool": lambda v: isinstance(v, bool),
            "handles": lambda v: isinstance(v, list) and all(h in HANDLES for h in v) and len(set(v)) == len(v),
        }[kind](value)
        if not ok:
            expected = {
                "identifier": "a Python name",
                "dotted": "a dotted name such as transformers.AutoModelForCausalLM",
                "word": f"one of {list(FAMILIES)}",
                "list": f"an array of distinct capabilities from {list(CAPABILITIES)}",
                "table": "a table",
                "bool": "true or false",
                "handles": f"an array of distinct config options from {list(HANDLES)} that the patched code honours",
            }[kind]
            raise PatchgenError(f"{where}: [model] key {key!r} must be {expected}, found {value!r}")
    for key in ("tiny", "data"):
        _check_data(where, key, table.get(key, {}), tiny=key == "tiny", depth=1)
    return ModelTable(
        table["model_type"],
        table["class"],
        table["upstream"],
        table["family"],
        tuple(table.get("capabilities", [])),
        dict(table.get("tiny", {})),
        dict(table.get("data", {})),
        table.get("conversions", True),
        tuple(table.get("handles", [])),
        {capability: reason.strip() for capability, reason in table.get("unsupported", {}).items()},
    )


def _check_unsupported_table(where: str, value: Any) -> None:
    """`[model.unsupported]`: capability (sp, ring, ep) -> a one-line reason why the generated class lacks it."""
    if not isinstance(value, dict):
        raise PatchgenError(
            f"{where}: [model] key 'unsupported' must be a table of capability = \"reason\" "
            f"(capabilities {list(UNSUPPORTED_CAPABILITIES)}), found {type_name(value)}"
        )
    for capability, reason in value.items():
        if capability not in UNSUPPORTED_CAPABILITIES:
            raise PatchgenError(
                f"{where}: [model.unsupported] has unknown capability {capability!r}; expected one of "
                f"{list(UNSUPPORTED_CAPABILITIES)}: rename or remove the key"
            )
        text = reason.strip() if isinstance(reason, str) else None
        if not text or not text.isprintable() or len(text) > MAX_REASON_CHARS:
            found = f"{len(text)} characters" if isinstance(text, str) else type_name(reason)
            raise PatchgenError(
                f"{where}: [model.unsupported] key {capability!r} must say in one line of at most {MAX_REASON_CHARS} "
                f"characters (no line breaks or control characters) why the class lacks {capability}, found {found}; "
                f"state the reason, or remove the key"
            )


def _check_data(where: str, key: str, value: Any, tiny: bool, depth: int) -> None:
    """One value of `[model.tiny]` / `[model.data]` (`key` is its dotted path there): a bounded table, array,
    string, boolean or number; in a tiny config a number is never negative nor larger than the tiny limits, and a
    size or count (`num_*`, `*_size`, `*_dim`, `*_layers`, `*_heads`, `depth`) is an integer or an array of them."""
    name = key.rsplit(".", 1)[-1]

    def refuse(expected: str) -> PatchgenError:
        text = repr(value)
        found = f"{type_name(value)} {text if len(text) <= 60 else text[:57] + '...'}"
        return PatchgenError(f"{where}: [model] key {key!r} must be {expected}, found {found}")

    if not is_identifier(name):
        raise PatchgenError(f"{where}: [model] key {key!r}: keys are Python names (configuration attributes)")
    if isinstance(value, dict):
        if depth > MAX_TABLE_DEPTH:
            raise refuse(f"a value: tables nest at most {MAX_TABLE_DEPTH} deep in [model.tiny] and [model.data]")
        if len(value) > MAX_TABLE_KEYS:
            raise refuse(f"a table of at most {MAX_TABLE_KEYS} keys")
        for sub, item in value.items():  # the tables under data.tiny_variants are tiny configs
            _check_data(where, f"{key}.{sub}", item, tiny or key == "data.tiny_variants", depth + 1)
        return
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and len(value) > MAX_ARRAY_ITEMS:
        raise refuse(f"an array of at most {MAX_ARRAY_ITEMS} items")
    count = tiny and _COUNT_KEY.fullmatch(name) is not None
    for item in items:
        if isinstance(item, bool):
            ok = not count
        elif isinstance(item, int):
            ok = (0 <= item <= MAX_TINY_INT) if tiny else abs(item) <= MAX_DATA_NUMBER
        elif isinstance(item, float):
            bound = (0 <= item <= MAX_TINY_FLOAT) if tiny else abs(item) <= MAX_DATA_NUMBER
            ok = not count and math.isfinite(item) and bound
        elif isinstance(item, str):
            ok = not count and len(item) <= MAX_STRING_CHARS and _DATA_STRING.fullmatch(item) is not None
        else:  # a date or time, an array of arrays or of tables
            ok = False
        if not ok:
            raise refuse(_expected(count, tiny))


def _expected(count: bool, tiny: bool) -> str:
    if count:
        return f"an integer from 0 to {MAX_TINY_INT} (a size or count of a tiny config), or an array of them"
    numbers = (
        f"integers from 0 to {MAX_TINY_INT}, finite floats from 0 to {MAX_TINY_FLOAT:g}"
        if tiny
        else f"finite numbers of magnitude at most {MAX_DATA_NUMBER}"
    )
    return (
        f"a boolean, a string of at most {MAX_STRING_CHARS} characters from A-Z a-z 0-9 _ . + -, or a number "
        f"({numbers}), or an array of at most {MAX_ARRAY_ITEMS} of those, or a table"
    )
