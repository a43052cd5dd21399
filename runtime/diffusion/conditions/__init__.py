"""Frozen condition models of the DiTs (see ``base.py`` for the API).

A spec's ``[model.data] condition_model_type = "<name>"`` names the module ``runtime.diffusion.conditions.<name>``,
which defines exactly one ``ConditionModel`` subclass: adding a DiT adds that module, no registry edit.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from typing import Any

from runtime.diffusion.conditions.base import ConditionInputs, ConditionModel

__all__ = ["ConditionInputs", "ConditionModel", "condition_model_class", "load_condition_model"]


def condition_model_class(condition_model_type: str) -> type[ConditionModel]:
    """The ``ConditionModel`` subclass that ``runtime.diffusion.conditions.<condition_model_type>`` defines."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", condition_model_type or ""):
        raise ValueError(f"condition model type {condition_model_type!r} is not a module name ([a-z][a-z0-9_]*)")
    name = f"{__name__}.{condition_model_type}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ValueError(
            f"no condition model {condition_model_type!r}: add runtime/diffusion/conditions/{condition_model_type}.py "
            f"with its ConditionModel subclass"
        ) from None
    found = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, ConditionModel) and cls.__module__ == name
    ]
    if len(found) != 1:
        raise ValueError(
            f"{name} must define exactly one ConditionModel subclass, found {[c.__name__ for c in found]}"
        )
    return found[0]


def load_condition_model(condition_model_type: str, path: str | os.PathLike, **options: Any) -> ConditionModel:
    """The frozen condition model of ``condition_model_type`` from a diffusers pipeline directory."""
    return condition_model_class(condition_model_type).from_pretrained(path, **options)
