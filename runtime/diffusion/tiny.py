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


def _flux(directory: Path, seed: int) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    config = tiny_config("flux")
    tokenizer, tokenizer_2 = _tokenizer(model_max_length=77), _tokenizer()
    torch.manual_seed(seed)
    clip = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=config["pooled_projection_dim"],
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    t5 = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=config["joint_attention_dim"],
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    vae = AutoencoderKL(  # 4 blocks: the x8 scale factor FluxPipeline derives from block_out_channels
        block_out_channels=[8, 8, 8, 8],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=config["in_channels"] // 4,
        layers_per_block=1,
        norm_num_groups=4,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=CLIPTextModel(clip),
        tokenizer=tokenizer,
        text_encoder_2=T5EncoderModel(t5),
        tokenizer_2=tokenizer_2,
        transformer=FluxTransformer2DModel(**config),
    ).save_pretrained(directory)
    return directory


def _qwenimage(directory: Path, seed: int) -> Path:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    from runtime.models.tiny import tiny_config as tiny_transformers_config

    config = tiny_config("qwenimage")
    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    text_encoder_config = tiny_transformers_config("qwen2_5_vl", text_config={"vocab_size": len(tokenizer)})
    if text_encoder_config.get_text_config().hidden_size != config["joint_attention_dim"]:
        raise ValueError("specs/qwenimage.toml: joint_attention_dim must be the tiny qwen2_5_vl text hidden size")
    vae = AutoencoderKLQwenImage(  # 3 temporal-downsample entries: the x8 scale factor QwenImagePipeline derives
        base_dim=8,
        z_dim=config["out_channels"],
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        time_shift_type="exponential",
    )
    QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration(text_encoder_config),
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(**config),
    ).save_pretrained(directory)
    return directory


def save_tiny_pipeline(kind: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny ``kind`` pipeline ("wan_t2v", "wan_i2v", "flux", "qwenimage") to ``directory``."""
    directory = Path(directory)
    builders = {
        "wan_t2v": lambda: _wan(directory, False, seed),
        "wan_i2v": lambda: _wan(directory, True, seed),
        "flux": lambda: _flux(directory, seed),
        "qwenimage": lambda: _qwenimage(directory, seed),
    }
    if kind not in builders:
        raise ValueError(f"unknown tiny pipeline {kind!r}; known: {', '.join(sorted(builders))}")
    return builders[kind]()
