"""HF `model_type` -> the generated class that trains it.

Entries are import paths, resolved lazily, so looking a model up never imports the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class GeneratedModel:
    model_type: str
    module: str  # generated module, written by `patchgen regen <spec>`
    causal_lm: str
    spec: str

    def causal_lm_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.causal_lm)


REGISTRY: dict[str, GeneratedModel] = {
    m.model_type: m
    for m in (
        GeneratedModel("qwen3", "generated.qwen3.modeling_qwen3", "Qwen3ForCausalLM", "qwen3"),
        GeneratedModel("llama", "generated.llama.modeling_llama", "LlamaForCausalLM", "llama"),
        GeneratedModel("qwen3_moe", "generated.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    )
}


def lookup(model_type: str) -> GeneratedModel:
    try:
        return REGISTRY[model_type]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"no generated model for model_type {model_type!r}; known: {known}. Add a spec under "
                         f"specs/, run `patchgen regen`, and register it in runtime/models/registry.py") from None


def causal_lm_class(model_type: str) -> type:
    return lookup(model_type).causal_lm_class()
