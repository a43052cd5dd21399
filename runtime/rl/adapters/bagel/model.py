"""A BAGEL-style mixture-of-transformers (MoT) denoiser, ``BagelMoT`` (a ``NonDiffusersModelBase``).

The model is a small Qwen2-like decoder whose every layer has TWO pathways with the same shapes: the
"understanding" weights (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp``) used by text and special tokens, and the "generation" weights (the same names
with ``_moe_gen``) used by latent tokens. Each token is projected by its own pathway, then ALL tokens attend jointly
(one bidirectional attention over the whole sequence, with a key-padding mask), then each token goes through its own
pathway's output projection and MLP. The sequence is::

    [text tokens (L)] [<soi> cond-latent tokens (N) <eoi>]?  [<soi> noisy-latent tokens (N) <eoi>]

(``<soi>``/``<eoi>``: the start/end-of-image token ids of the vocabulary, text pathway; the condition-image block
only when ``cond_latents`` is given, at timestep 0 as BAGEL feeds clean VAE latents.) A latent token is
``vae2llm(patch) + time_embedder(t) + latent_pos_embed(row, col)``; the velocity is ``llm2vae(norm_moe_gen(h))``
of the noisy-latent tokens, unpatchified. RoPE positions: text ``0 .. L-1``, each image block one shared position
(BAGEL's convention). Attention runs in the dtype of the model's weights (``F.scaled_dot_product_attention`` on the
projected q/k/v, never upcast here).

``BagelMoT.read_weights`` reads BAGEL's ``ema.safetensors`` through the name map of ``checkpoint.py``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from runtime.rl.adapters.bagel.checkpoint import BAGEL_WEIGHTS_NAME, from_bagel_keys
from runtime.rl.adapters.nondiffusers import NonDiffusersModelBase

__all__ = ["BagelMoT", "TINY_MOT_CONFIG"]

TINY_MOT_CONFIG: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "latent_channels": 4,
    "latent_patch_size": 2,
    "max_latent_size": 8,  # patches per side the position embedding covers
    "timestep_freq_dim": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "start_of_image_token_id": 62,
    "end_of_image_token_id": 63,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Qwen2's: statistics in fp32, output in the input dtype
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class MoTAttention(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        h, self.n_heads, self.n_kv = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"]
        self.head_dim = h // self.n_heads
        for sfx in ("", "_moe_gen"):
            setattr(self, f"q_proj{sfx}", nn.Linear(h, self.n_heads * self.head_dim, bias=True))
            setattr(self, f"k_proj{sfx}", nn.Linear(h, self.n_kv * self.head_dim, bias=True))
            setattr(self, f"v_proj{sfx}", nn.Linear(h, self.n_kv * self.head_dim, bias=True))
            setattr(self, f"o_proj{sfx}", nn.Linear(self.n_heads * self.head_dim, h, bias=False))
            setattr(self, f"q_norm{sfx}", RMSNorm(self.head_dim, cfg["rms_norm_eps"]))
            setattr(self, f"k_norm{sfx}", RMSNorm(self.head_dim, cfg["rms_norm_eps"]))

    def _project(self, x: torch.Tensor, gen: torch.Tensor, name: str, heads: int) -> torch.Tensor:
        """Pathway-routed projection + per-head norm: text rows use ``name``, generation rows ``name_moe_gen``."""
        b, s, _ = x.shape
        out = x.new_empty(b, s, heads * self.head_dim)
        out[~gen] = getattr(self, f"{name}_proj")(x[~gen])
        out[gen] = getattr(self, f"{name}_proj_moe_gen")(x[gen])
        out = out.view(b, s, heads, self.head_dim)
        if name in ("q", "k"):
            normed = out.new_empty(out.shape)
            normed[~gen] = getattr(self, f"{name}_norm")(out[~gen])
            normed[gen] = getattr(self, f"{name}_norm_moe_gen")(out[gen])
            out = normed
        return out.transpose(1, 2)  # [B, heads, S, D]

    def forward(self, x, gen, cos, sin, mask):
        q = self._project(x, gen, "q", self.n_heads)
        k = self._project(x, gen, "k", self.n_kv)
        v = self._project(x, gen, "v", self.n_kv)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # attention in the weights' dtype: q/k/v come out of the projections in it (no upcast here)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        out = attn.new_empty(x.shape)
        out[~gen] = self.o_proj(attn[~gen])
        out[gen] = self.o_proj_moe_gen(attn[gen])
        return out


class MoTDecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = MoTAttention(cfg)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.mlp_moe_gen = MLP(h, cfg["intermediate_size"])
        for sfx in ("", "_moe_gen"):
            setattr(self, f"input_layernorm{sfx}", RMSNorm(h, eps))
            setattr(self, f"post_attention_layernorm{sfx}", RMSNorm(h, eps))

    @staticmethod
    def _routed(x, gen, text_fn, gen_fn):
        out = x.new_empty(x.shape)
        out[~gen] = text_fn(x[~gen])
        out[gen] = gen_fn(x[gen])
        return out

    def forward(self, x, gen, cos, sin, mask):
        h = self._routed(x, gen, self.input_layernorm, self.input_layernorm_moe_gen)
        x = x + self.self_attn(h, gen, cos, sin, mask)
        h = self._routed(x, gen, self.post_attention_layernorm, self.post_attention_layernorm_moe_gen)
        return x + self._routed(h, gen, self.mlp, self.mlp_moe_gen)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` in [0, 1] (sigma), ``[B]``; the sinusoid of ``1000 t`` in fp32, the MLP in ``dtype``."""
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = (t.float() * 1000.0)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(dtype))


class LatentPosEmbed(nn.Module):
    def __init__(self, max_size: int, hidden: int):
        super().__init__()
        self.max_size = max_size
        self.pos_embed = nn.Parameter(torch.randn(max_size * max_size, hidden) * 0.02)

    def forward(self, h: int, w: int) -> torch.Tensor:
        if h > self.max_size or w > self.max_size:
            raise ValueError(f"latent grid {h}x{w} patches exceeds max_latent_size {self.max_size}")
        rows = torch.arange(h, device=self.pos_embed.device)[:, None] * self.max_size
        ids = (rows + torch.arange(w, device=self.pos_embed.device)[None]).reshape(-1)
        return self.pos_embed[ids]


class BagelMoT(NonDiffusersModelBase):
    """See the module docstring. ``forward(input_ids, latents, timestep, ...) -> velocity`` shaped like latents."""

    _no_split_modules: ClassVar[list[str]] = ["MoTDecoderLayer"]
    weight_files: ClassVar[tuple[str, ...]] = ("ema.safetensors",)  # BAGEL's, read by read_weights

    def __init__(self, config: dict[str, Any]):
        super().__init__({**TINY_MOT_CONFIG, **config})
        c = self.config
        h = c["hidden_size"]
        self.patch_dim = c["latent_channels"] * c["latent_patch_size"] ** 2
        self.embed_tokens = nn.Embedding(c["vocab_size"], h)
        self.layers = nn.ModuleList(MoTDecoderLayer(c) for _ in range(c["num_layers"]))
        self.norm = RMSNorm(h, c["rms_norm_eps"])
        self.norm_moe_gen = RMSNorm(h, c["rms_norm_eps"])
        self.lm_head = nn.Linear(h, c["vocab_size"], bias=False)  # kept for checkpoint parity; unused by forward
        self.time_embedder = TimestepEmbedder(h, c["timestep_freq_dim"])
        self.vae2llm = nn.Linear(self.patch_dim, h)
        self.llm2vae = nn.Linear(h, self.patch_dim)
        self.latent_pos_embed = LatentPosEmbed(c["max_latent_size"], h)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    @classmethod
    def read_weights(cls, load_directory: str | os.PathLike) -> dict[str, torch.Tensor]:
        """BAGEL's ``ema.safetensors`` (its names mapped to ours, the ViT tower left out) when the directory holds
        one, else our own ``model.safetensors``; a BAGEL key no map covers is refused by name."""
        ema = Path(load_directory) / BAGEL_WEIGHTS_NAME
        if not ema.is_file():
            return super().read_weights(load_directory)
        mapped, unmapped = from_bagel_keys(load_file(ema))
        if unmapped:
            raise KeyError(f"{ema}: {len(unmapped)} weight(s) this model does not have: {', '.join(unmapped[:4])}")
        return mapped

    def token_layout(self, input_ids: Sequence[int], latent_hw: tuple[int, int]) -> list[int]:
        """The token ids of the sequence ``forward`` builds for one sample without a condition image: the text ids,
        then ``<soi>``, one ``-1`` per latent token, ``<eoi>`` (what BAGEL's ``prepare_prompts`` +
        ``prepare_vae_latent`` lay out)."""
        p = self.config["latent_patch_size"]
        n = (latent_hw[0] // p) * (latent_hw[1] // p)
        soi, eoi = self.config["start_of_image_token_id"], self.config["end_of_image_token_id"]
        return [int(i) for i in input_ids] + [soi] + [-1] * n + [eoi]

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config["latent_patch_size"]
        b, c, hh, ww = x.shape
        x = x.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (hh // p) * (ww // p), p * p * c)

    def _unpatchify(self, x: torch.Tensor, hh: int, ww: int) -> torch.Tensor:
        p, c = self.config["latent_patch_size"], self.config["latent_channels"]
        b = x.shape[0]
        x = x.reshape(b, hh // p, ww // p, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, c, hh, ww)

    def _image_block(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, _, hh, ww = latents.shape
        p = self.config["latent_patch_size"]
        tokens = self.vae2llm(self._patchify(latents.to(self.dtype)))
        tokens = tokens + self.time_embedder(t, self.dtype)[:, None] + self.latent_pos_embed(hh // p, ww // p)[None]
        ids = torch.tensor([self.config["start_of_image_token_id"], self.config["end_of_image_token_id"]])
        soi, eoi = self.embed_tokens(ids.to(latents.device)).unbind(0)
        return torch.cat([soi.expand(b, 1, -1), tokens, eoi.expand(b, 1, -1)], dim=1)

    def _rope(self, positions: torch.Tensor, device: torch.device):
        d = self.config["hidden_size"] // self.config["num_heads"]
        inv = 1.0 / (self.config["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        freqs = positions.float()[:, None] * inv[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype)[None, None], emb.sin().to(self.dtype)[None, None]

    def forward(
        self,
        input_ids: torch.Tensor,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text_mask: torch.Tensor | None = None,
        cond_latents: torch.Tensor | None = None,
        cond_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids`` ``[B, L]``, ``latents`` ``[B, C, H, W]``, ``timestep`` ``[B]`` sigmas in [0, 1];
        ``text_mask`` ``[B, L]`` / ``cond_mask`` ``[B]`` (bool, False = hidden from attention); returns fp32
        velocity ``[B, C, H, W]``."""
        b, _, hh, ww = latents.shape
        dev = latents.device
        seq_len = input_ids.shape[1]
        parts, gen_parts, keep = [self.embed_tokens(input_ids)], [], []
        gen_parts.append(torch.zeros(b, seq_len, dtype=torch.bool, device=dev))
        keep.append(torch.ones(b, seq_len, dtype=torch.bool, device=dev) if text_mask is None else text_mask.bool())
        positions = [torch.arange(seq_len, device=dev)]
        pos = seq_len
        blocks = []
        if cond_latents is not None:
            blocks.append((cond_latents, torch.zeros(b, device=dev), cond_mask))
        blocks.append((latents, timestep.to(dev).reshape(b), None))
        for lat, t, m in blocks:
            block = self._image_block(lat, t)
            n = block.shape[1]
            parts.append(block)
            gen = torch.ones(b, n, dtype=torch.bool, device=dev)
            gen[:, 0] = gen[:, -1] = False  # <soi>/<eoi> are text-pathway tokens
            gen_parts.append(gen)
            keep.append(
                torch.ones(b, n, dtype=torch.bool, device=dev) if m is None else m.bool()[:, None].expand(b, n)
            )
            positions.append(torch.full((n,), pos, device=dev))
            pos += 1
        x = torch.cat(parts, dim=1)
        gen = torch.cat(gen_parts, dim=1)
        mask = torch.cat(keep, dim=1)[:, None, None, :]  # [B, 1, 1, S] key-padding mask
        cos, sin = self._rope(torch.cat(positions), dev)
        for layer in self.layers:
            x = self.maybe_checkpoint(layer, x, gen, cos, sin, mask)
        n_lat = (hh // self.config["latent_patch_size"]) * (ww // self.config["latent_patch_size"])
        h = self.norm_moe_gen(x[:, -n_lat - 1 : -1])
        return self._unpatchify(self.llm2vae(h), hh, ww).float()
