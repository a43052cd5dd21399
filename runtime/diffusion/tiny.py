"""Tiny random DiT pipelines saved as real diffusers pipeline directories (no downloads), for tests and demos.

Each ``save_tiny_pipeline(kind, directory)`` builds every component from a tiny config (a byte-level BPE tokenizer
trained on the bundled corpus, random text/image encoders, a random VAE, a flow-matching scheduler and a random
transformer from the tiny config of its spec's ``[model]`` table) and writes it with ``pipeline.save_pretrained``, so
loading it goes through diffusers' and transformers' real loading code.
"""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from runtime.diffusion.registry import tiny_config

__all__ = ["WAN_I2V_TEXT_LEN", "save_tiny_pipeline"]

WAN_I2V_TEXT_LEN = 512  # Wan's attention splits image/text context at a hard-coded 512 text tokens


def _tokenizer(**kwargs: Any) -> Any:
    """A byte-level BPE trained on the bundled corpus (the pipeline saves it with its other components)."""
    from transformers import AutoTokenizer

    from runtime.data.tokenization import build_test_tokenizer

    corpus = resources.files("runtime.data.corpus").joinpath("corpus.txt").read_text()
    with tempfile.TemporaryDirectory() as scratch:
        build_test_tokenizer(scratch, corpus, vocab_size=400)
        return AutoTokenizer.from_pretrained(scratch, **kwargs)


def _umt5(vocab_size: int, d_model: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
    )
    return UMT5EncoderModel(config)


def _wan_vae(z_dim: int) -> Any:
    from diffusers import AutoencoderKLWan

    # 3 spatial downsamples (x8) and 2 temporal ones (x4): the scale factors the pipelines assume.
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )


def _clip_vision(hidden_size: int) -> tuple[Any, Any]:
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


def _wan(directory: Path, i2v: bool, seed: int) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    config = tiny_config("wan", "i2v" if i2v else None)
    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    components: dict[str, Any] = dict(
        tokenizer=tokenizer,
        text_encoder=_umt5(len(tokenizer), config["text_dim"]),
        vae=_wan_vae(tiny_config("wan")["in_channels"]),  # T2V in_channels: the latent channels
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=WanTransformer3DModel(**config),
    )
    if i2v:
        components["image_encoder"], components["image_processor"] = _clip_vision(config["image_dim"])
    pipeline = (WanImageToVideoPipeline if i2v else WanPipeline)(**components)
    pipeline.save_pretrained(directory)
    return directory


def save_tiny_pipeline(kind: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny ``kind`` pipeline ("wan_t2v", "wan_i2v") to ``directory``; returns the directory."""
    directory = Path(directory)
    builders = {"wan_t2v": lambda: _wan(directory, False, seed), "wan_i2v": lambda: _wan(directory, True, seed)}
    if kind not in builders:
        raise ValueError(f"unknown tiny pipeline {kind!r}; known: {', '.join(sorted(builders))}")
    return builders[kind]()
