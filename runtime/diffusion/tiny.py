"""Tiny random DiT pipelines saved as real diffusers pipeline directories (no downloads), for tests and demos.

Each ``save_tiny_pipeline(kind, directory)`` builds every component from a tiny config (a byte-level BPE tokenizer
trained on the bundled corpus, random text/image encoders, a random VAE, a flow-matching scheduler and a random
transformer from the ``TINY_*`` configs below) and writes it with ``pipeline.save_pretrained``, so loading it goes
through diffusers' and transformers' real loading code.
"""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_WAN_I2V", "TINY_WAN_T2V", "WAN_I2V_TEXT_LEN", "save_tiny_pipeline"]

# Wan transformer: head_dim 12 splits into RoPE t/h/w = 4/4/4; 4 heads so sp=2 and sp=4 divide them; text_dim is
# the tiny UMT5's d_model, in_channels the tiny VAE's z_dim.
TINY_WAN_T2V: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
)
# I2V: CLIP image embeddings (image_dim = the tiny CLIP's hidden size) and the cross-attention's added K/V
# projections; in_channels = noisy latents (z_dim) + first-frame mask (VAE temporal factor 4) + first-frame latents.
TINY_WAN_I2V: dict[str, Any] = {**TINY_WAN_T2V, "in_channels": 12, "image_dim": 24, "added_kv_proj_dim": 48}
WAN_I2V_TEXT_LEN = 512  # Wan's attention splits image/text context at a hard-coded 512 text tokens

_Z_DIM = 4


def _tokenizer(**kwargs: Any) -> Any:
    """A byte-level BPE trained on the bundled corpus (the pipeline saves it with its other components)."""
    from transformers import AutoTokenizer

    from runtime.data.tokenization import build_test_tokenizer

    corpus = resources.files("runtime.data.corpus").joinpath("corpus.txt").read_text()
    with tempfile.TemporaryDirectory() as scratch:
        build_test_tokenizer(scratch, corpus, vocab_size=400)
        return AutoTokenizer.from_pretrained(scratch, **kwargs)


def _umt5(vocab_size: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=TINY_WAN_T2V["text_dim"],
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
    )
    return UMT5EncoderModel(config)


def _wan_vae() -> Any:
    from diffusers import AutoencoderKLWan

    # 3 spatial downsamples (x8) and 2 temporal ones (x4): the scale factors the pipelines assume.
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=_Z_DIM,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )


def _clip_vision() -> tuple[Any, Any]:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=TINY_WAN_I2V["image_dim"],
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

    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    components: dict[str, Any] = dict(
        tokenizer=tokenizer,
        text_encoder=_umt5(len(tokenizer)),
        vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=WanTransformer3DModel(**(TINY_WAN_I2V if i2v else TINY_WAN_T2V)),
    )
    if i2v:
        components["image_encoder"], components["image_processor"] = _clip_vision()
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
