"""``save_tiny_bagel``: a tiny random BAGEL-style checkpoint directory for tests, demos and the docs."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.rl.adapters.bagel.checkpoint import (
    BAGEL_SPECIAL_TOKENS,
    BAGEL_WEIGHTS_NAME,
    bagel_new_token_ids,
    save_bagel_checkpoint,
)
from runtime.rl.adapters.bagel.model import BagelMoT

__all__ = ["save_tiny_bagel"]


def save_tiny_bagel(directory: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random BAGEL-style checkpoint directory, for tests and demos (no download): ``config.json``,
    ``ema.safetensors`` under BAGEL's names, a tokenizer with BAGEL's four special tokens, and ``vae/`` (a tiny
    ``AutoencoderKL`` with 4 latent channels and BAGEL's FLUX-VAE normalisation, x8 downsampling)."""
    from diffusers import AutoencoderKL

    from runtime.diffusion.tiny_pipelines import tiny_tokenizer

    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(BAGEL_SPECIAL_TOKENS.values())})
    ids = bagel_new_token_ids(tokenizer)
    torch.manual_seed(seed)
    model = BagelMoT(
        {
            "vocab_size": len(tokenizer),
            "start_of_image_token_id": ids["start_of_image"],
            "end_of_image_token_id": ids["end_of_image"],
        }
    )
    directory.mkdir(parents=True)
    model.save_pretrained(directory)  # config.json (and our model.safetensors, replaced by BAGEL's file below)
    (directory / "model.safetensors").unlink()
    save_bagel_checkpoint(model, str(directory / BAGEL_WEIGHTS_NAME))
    tokenizer.save_pretrained(directory)
    AutoencoderKL(
        block_out_channels=[8, 8, 8, 8],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=model.config["latent_channels"],
        layers_per_block=1,
        norm_num_groups=4,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    ).save_pretrained(directory / "vae")
    return directory
