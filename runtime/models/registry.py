"""HF `model_type` -> the generated class that trains it, read from the specs' `[model]` tables.

`patchgen regen` writes each spec's `[model]` table beside its generated module as `<module>.model.json`; this
registry reads those records and nothing else, so a spec is the single source of a model (its class, upstream
reference, family, capabilities, tiny test config and data settings). Modules are imported lazily: looking a model
up never imports the others.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import generated

RECORD_SUFFIX = ".model.json"
_REQUIRED = ("spec", "module", "model_type", "class", "upstream", "family", "capabilities", "tiny", "data", "supports")


@dataclass(frozen=True)
class Supports:
    """What the generated class can do, as patchgen derived it from the patches it applied (not a hand-written
    claim): sequence parallelism, a ring, expert parallelism, the patched attention sites, the module paths that
    run on replicated tokens before the split, and the config options its patched code declares it honours; and, for
    a capability it lacks, the one-line reason its spec states (``[model.unsupported]``: sp, ring, ep)."""

    sp: bool = False
    ring: bool = False
    ep: bool = False
    attention_sites: tuple[str, ...] = ()
    replicated_modules: tuple[str, ...] = ()
    handles: tuple[str, ...] = ()
    unsupported: dict[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> Supports:
        return cls(
            bool(raw["sp"]),
            bool(raw["ring"]),
            bool(raw["ep"]),
            tuple(raw["attention_sites"]),
            tuple(raw["replicated_modules"]),
            tuple(raw["handles"]),
            {str(key): str(reason) for key, reason in raw.get("unsupported", {}).items()},
        )


@dataclass(frozen=True)
class GeneratedModel:
    model_type: str
    module: str  # generated module, written by `patchgen regen <spec>`
    causal_lm: str  # the generated class that trains it (a *ForCausalLM, a VLM's *ForConditionalGeneration, a DiT)
    spec: str
    upstream: str  # dotted: transformers.AutoModelForCausalLM, diffusers.WanTransformer3DModel, ...
    family: str  # causal_lm | vlm | omni | dit
    capabilities: tuple[str, ...] = ()
    tiny: dict[str, Any] = field(default_factory=dict, hash=False)
    data: dict[str, Any] = field(default_factory=dict, hash=False)
    supports: Supports = Supports()

    @property
    def is_vlm(self) -> bool:
        """Trained from chat samples with images/videos through a processor (VLMs and omni models)."""
        return self.family in ("vlm", "omni")

    @property
    def is_moe(self) -> bool:
        return "moe" in self.capabilities

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    @property
    def tiny_variants(self) -> dict[str, dict[str, Any]]:
        """Named overrides of the tiny config (``[model.data.tiny_variants.<name>]``): each reaches config-gated
        branches of the patched code the tiny config does not (tests/models/test_branch_reach.py)."""
        return self.data.get("tiny_variants", {})

    def model_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.causal_lm)

    causal_lm_class = model_class

    def upstream_class(self) -> type:
        """The upstream class (or transformers Auto class) that builds the reference model."""
        package, _, name = self.upstream.rpartition(".")
        return getattr(importlib.import_module(package), name)

    upstream_auto_class = upstream_class

    @property
    def upstream_auto(self) -> str:
        return self.upstream.rpartition(".")[2]


def _record(path: Path) -> GeneratedModel:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        missing = [key for key in _REQUIRED if key not in raw]
        if missing:
            raise ValueError(f"missing keys {missing}")
        supports = Supports.from_record(raw["supports"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"{path}: not a model record written by `patchgen regen` ({exc}); regenerate it") from exc
    return GeneratedModel(
        raw["model_type"],
        raw["module"],
        raw["class"],
        raw["spec"],
        raw["upstream"],
        raw["family"],
        tuple(raw["capabilities"]),
        raw["tiny"],
        raw["data"],
        supports,
    )


def _load() -> dict[str, GeneratedModel]:
    table: dict[str, GeneratedModel] = {}
    for path in sorted(Path(generated.__file__).parent.rglob("*" + RECORD_SUFFIX)):
        entry = _record(path)
        if entry.model_type in table:
            other = table[entry.model_type].spec
            raise RuntimeError(f"{path}: model_type {entry.model_type!r} is also spec {other!r}'s; give each its own")
        table[entry.model_type] = entry
    return table


REGISTRY: dict[str, GeneratedModel] = _load()


def lookup(model_type: str) -> GeneratedModel:
    try:
        return REGISTRY[model_type]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(
            f"no generated model for model_type {model_type!r}; known: {known}. Add a spec with a [model] table "
            f"under specs/ and run `patchgen regen`"
        ) from None


def causal_lm_class(model_type: str) -> type:
    return lookup(model_type).model_class()


def variant_cases(types: list[str]) -> list[tuple[str, str | None]]:
    """``(model_type, None)`` for each type's tiny config, then ``(model_type, variant)`` for each of its variants:
    what a parity suite runs so that every config-gated branch is compared."""
    return [(t, v) for t in types for v in (None, *lookup(t).tiny_variants)]


def variant_overrides(model_type: str, variant: str | None) -> dict[str, Any]:
    """The overrides of a tiny variant (``{}`` for the tiny config itself)."""
    return {} if variant is None else dict(lookup(model_type).tiny_variants[variant])


def model_types(family: str | None = None, capability: str | None = None, without: str | None = None) -> list[str]:
    """Registered model types, optionally of one family / with or without a capability (test parametrization)."""
    return sorted(
        m.model_type
        for m in REGISTRY.values()
        if (family is None or m.family == family)
        and (capability is None or m.has(capability))
        and (without is None or not m.has(without))
    )
