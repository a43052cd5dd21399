"""A spec's `[model]` table: what the runtime needs to know about the model a spec generates.

The spec is the single source of a model. Its `[model]` table says which generated class trains it, how the upstream
reference is built, which family of trainer and test suites it belongs to, what it can do (capabilities), a tiny
random config that runs every patched path, and family-specific data. `patchgen regen` writes it next to the
generated module as `<output>.model.json`; the runtime registry and the tests read only that file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from patchgen.errors import PatchgenError
from patchgen.varkinds import is_dotted, is_identifier

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
}
REQUIRED_MODEL_KEYS = ("model_type", "class", "upstream", "family")
SIDECAR_SUFFIX = ".model.json"


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

    @property
    def implies_conversions(self) -> bool:
        """Whether the spec gets the implied `core/upstream_weight_conversions` patch: every transformers model
        loads every checkpoint layout its upstream class accepts (legacy key names, per-expert MoE files)."""
        return self.conversions and self.upstream.startswith("transformers.")

    def to_json(self, spec_name: str, output: str) -> str:
        """The sidecar's text: deterministic (sorted keys), importable module path included."""
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
        }
        return json.dumps(record, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


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
        ok = {
            "identifier": lambda v: isinstance(v, str) and is_identifier(v),
            "dotted": lambda v: isinstance(v, str) and is_dotted(v) and "." in v,
            "word": lambda v: v in FAMILIES,
            "list": lambda v: isinstance(v, list) and all(c in CAPABILITIES for c in v) and len(set(v)) == len(v),
            "table": lambda v: isinstance(v, dict),
            "bool": lambda v: isinstance(v, bool),
        }[kind](value)
        if not ok:
            expected = {
                "identifier": "a Python name",
                "dotted": "a dotted name such as transformers.AutoModelForCausalLM",
                "word": f"one of {list(FAMILIES)}",
                "list": f"an array of distinct capabilities from {list(CAPABILITIES)}",
                "table": "a table",
                "bool": "true or false",
            }[kind]
            raise PatchgenError(f"{where}: [model] key {key!r} must be {expected}, found {value!r}")
    return ModelTable(
        table["model_type"],
        table["class"],
        table["upstream"],
        table["family"],
        tuple(table.get("capabilities", [])),
        dict(table.get("tiny", {})),
        dict(table.get("data", {})),
        table.get("conversions", True),
    )
