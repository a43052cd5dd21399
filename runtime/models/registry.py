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
    causal_lm: str  # the generated class that trains it (a *ForCausalLM, or a VLM's *ForConditionalGeneration)
    spec: str
    upstream_auto: str = "AutoModelForCausalLM"  # the transformers Auto class that builds the upstream reference

    @property
    def is_vlm(self) -> bool:
        """A vision-language model: trained from chat samples with images/videos through a processor."""
        return self.upstream_auto == "AutoModelForImageTextToText"

    def causal_lm_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.causal_lm)

    def upstream_auto_class(self) -> type:
        import transformers

        return getattr(transformers, self.upstream_auto)


REGISTRY: dict[str, GeneratedModel] = {
    m.model_type: m
    for m in (
        GeneratedModel("qwen3", "generated.qwen3.modeling_qwen3", "Qwen3ForCausalLM", "qwen3"),
        GeneratedModel("llama", "generated.llama.modeling_llama", "LlamaForCausalLM", "llama"),
        GeneratedModel("qwen3_moe", "generated.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
        GeneratedModel(
            "qwen3_vl",
            "generated.qwen3_vl.modeling_qwen3_vl",
            "Qwen3VLForConditionalGeneration",
            "qwen3_vl",
            upstream_auto="AutoModelForImageTextToText",
        ),
        GeneratedModel(
            "qwen3_vl_moe",
            "generated.qwen3_vl_moe.modeling_qwen3_vl_moe",
            "Qwen3VLMoeForConditionalGeneration",
            "qwen3_vl_moe",
            upstream_auto="AutoModelForImageTextToText",
        ),
        GeneratedModel(
            "qwen2_5_vl",
            "generated.qwen2_5_vl.modeling_qwen2_5_vl",
            "Qwen2_5_VLForConditionalGeneration",
            "qwen2_5_vl",
            upstream_auto="AutoModelForImageTextToText",
        ),
    )
}


def lookup(model_type: str) -> GeneratedModel:
    try:
        return REGISTRY[model_type]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(
            f"no generated model for model_type {model_type!r}; known: {known}. Add a spec under "
            f"specs/, run `patchgen regen`, and register it in runtime/models/registry.py"
        ) from None


def causal_lm_class(model_type: str) -> type:
    return lookup(model_type).causal_lm_class()
