"""DiT ``model_type`` -> the generated trainable class, its diffusers upstream class and its condition model.

The one place that lists the DiTs until specs carry a ``[model]`` table (``family = "dit"``); then this data moves
into specs/{wan,flux,qwenimage}.toml and the generated registry replaces this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class DiTModel:
    model_type: str
    module: str  # the generated module
    cls: str  # the trainable PreTrainedModel shell in it
    upstream: str  # "diffusers.<Class>": the reference implementation
    condition_model_type: str
    spec: str

    def model_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)

    def upstream_class(self) -> type:
        package, name = self.upstream.split(".", 1)
        return getattr(importlib.import_module(package), name)


DIT_MODELS: dict[str, DiTModel] = {
    m.model_type: m
    for m in (
        DiTModel(
            "wan",
            "generated.wan.transformer_wan",
            "WanTransformer3DModelForTraining",
            "diffusers.WanTransformer3DModel",
            "wan",
            "wan",
        ),
    )
}


def lookup_dit(model_type: str) -> DiTModel:
    try:
        return DIT_MODELS[model_type]
    except KeyError:
        known = ", ".join(sorted(DIT_MODELS))
        raise ValueError(f"no generated DiT for model_type {model_type!r}; known: {known}") from None
