"""The DiTs of the model registry (``family = "dit"`` in a spec's ``[model]`` table).

A DiT record's class is the PreTrainedModel shell the ``dit/training_shell`` template writes into the generated
module; its ``data`` carries ``condition_model_type`` (the frozen condition model's registry key) and
``tiny_variants`` (named overrides of the tiny config, e.g. Wan's ``i2v``).
"""

from __future__ import annotations

from typing import Any

from runtime.models.registry import GeneratedModel, lookup, model_types

__all__ = ["dit_model_types", "lookup_dit", "tiny_cases", "tiny_config", "training_class"]


def dit_model_types() -> list[str]:
    return model_types("dit")


def lookup_dit(model_type: str) -> GeneratedModel:
    entry = lookup(model_type)
    if entry.family != "dit":
        raise ValueError(f"model_type {model_type!r} is a {entry.family} model, not a DiT")
    return entry


def training_class(model_type: str) -> type:
    """The generated PreTrainedModel shell that trains ``model_type``."""
    return lookup_dit(model_type).model_class()


def tiny_config(model_type: str, variant: str | None = None) -> dict[str, Any]:
    """The spec's tiny diffusers ``__init__`` arguments, with a named variant's overrides."""
    entry = lookup_dit(model_type)
    config = dict(entry.tiny)
    if variant is not None:
        variants = entry.data.get("tiny_variants", {})
        if variant not in variants:
            raise ValueError(f"{model_type}: no tiny variant {variant!r}; known: {sorted(variants)}")
        config.update(variants[variant])
    return config


def tiny_cases() -> dict[str, tuple[str, str | None]]:
    """Every tiny DiT configuration the specs declare: ``name -> (model_type, variant)``; the base config is named
    by its model type, a variant ``<model_type>_<variant>`` (``wan``, ``wan_i2v``, ``flux``, ...)."""
    cases: dict[str, tuple[str, str | None]] = {}
    for model_type in dit_model_types():
        cases[model_type] = (model_type, None)
        for variant in lookup_dit(model_type).data.get("tiny_variants", {}):
            cases[f"{model_type}_{variant}"] = (model_type, variant)
    return cases
