"""Frozen condition models of the DiTs, by ``condition_model_type`` (see ``base.py`` for the API)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from runtime.diffusion.conditions.base import ConditionInputs, ConditionModel

__all__ = ["CONDITION_MODELS", "ConditionInputs", "ConditionModel", "condition_model_class", "load_condition_model"]

# condition_model_type -> "module:class", imported on use
CONDITION_MODELS = {
    "wan": "runtime.diffusion.conditions.wan:WanConditionModel",
    "flux": "runtime.diffusion.conditions.flux:FluxConditionModel",
    "qwenimage": "runtime.diffusion.conditions.qwenimage:QwenImageConditionModel",
}


def condition_model_class(condition_model_type: str) -> type[ConditionModel]:
    try:
        module, name = CONDITION_MODELS[condition_model_type].split(":")
    except KeyError:
        known = ", ".join(sorted(CONDITION_MODELS))
        raise ValueError(f"no condition model {condition_model_type!r}; known: {known}") from None
    return getattr(importlib.import_module(module), name)


def load_condition_model(condition_model_type: str, path: str | os.PathLike, **options: Any) -> ConditionModel:
    """The frozen condition model of ``condition_model_type`` from a diffusers pipeline directory."""
    return condition_model_class(condition_model_type).from_pretrained(path, **options)
