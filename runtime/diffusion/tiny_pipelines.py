"""Tiny random DiT pipelines saved as real diffusers pipeline directories (no downloads), for tests and demos.

``save_tiny_pipeline(name, directory)`` builds the pipeline of a tiny case (``registry.tiny_cases``: a DiT's model
type, or ``<model_type>_<variant>``): its condition model's ``tiny_components`` (tokenizers trained on the bundled
corpus, random text/image encoders, a random VAE, a flow-matching scheduler) around a random transformer built
from the spec's tiny config, written with ``pipeline.save_pretrained`` so loading it goes through diffusers' and
transformers' real loading code. The component builders several models share live here.

Command line: ``python -m runtime.tiny pipeline wan pipelines/wan`` (``runtime/tiny.py``, which also builds tiny
tokenizers and processors).
"""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from runtime.diffusion.registry import lookup_dit, tiny_cases, tiny_config

__all__ = ["save_tiny_pipeline", "tiny_clip_text", "tiny_clip_vision", "tiny_t5", "tiny_tokenizer"]


def tiny_tokenizer(**kwargs: Any) -> Any:
    """A byte-level BPE trained on the bundled corpus (the pipeline saves it with its other components)."""
    from transformers import AutoTokenizer

    from runtime.data.text.tokenization import build_test_tokenizer

    corpus = resources.files("runtime.data.text.corpus").joinpath("corpus.txt").read_text()
    with tempfile.TemporaryDirectory() as scratch:
        build_test_tokenizer(scratch, corpus, vocab_size=400)
        return AutoTokenizer.from_pretrained(scratch, **kwargs)


def tiny_clip_text(tokenizer: Any, hidden_size: int) -> Any:
    """A one-layer CLIP text encoder (pooled output of ``hidden_size``) for ``tokenizer``."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModel(config)


def tiny_t5(tokenizer: Any, d_model: int, umt5: bool = False, **overrides: Any) -> Any:
    """A one-layer T5 text encoder of width ``d_model`` for ``tokenizer`` (``umt5``: UMT5, Wan's), the settings the
    T5-based pipelines share; ``overrides`` change its config."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    settings = {"d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 4, "relative_attention_num_buckets": 8}
    return model_class(config_class(vocab_size=len(tokenizer), d_model=d_model, **{**settings, **overrides}))


def tiny_clip_vision(hidden_size: int) -> tuple[Any, Any]:
    """A two-layer CLIP vision encoder and its image processor (32 px)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return CLIPVisionModel(config), processor


def save_tiny_pipeline(name: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny pipeline of case ``name`` (``registry.tiny_cases``) to ``directory``."""
    from runtime.diffusion.conditions import condition_model_class

    cases = tiny_cases()
    if name not in cases:
        raise ValueError(f"unknown tiny pipeline {name!r}; known: {', '.join(sorted(cases))}")
    model_type, variant = cases[name]
    entry = lookup_dit(model_type)
    condition = condition_model_class(entry.data["condition_model_type"])
    config = tiny_config(model_type, variant)
    torch.manual_seed(seed)
    components = condition.tiny_components(config, variant)
    components["transformer"] = entry.upstream_class()(**config)
    directory = Path(directory)
    condition.tiny_pipeline_class(variant)(**components).save_pretrained(directory)
    return directory
