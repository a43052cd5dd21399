"""A BAGEL-style mixture-of-transformers (MoT) denoiser and its Flow-GRPO adapter ``("BagelMoT", "flowgrpo")``.

The model (``BagelMoT``, a ``NonDiffusersModelBase``) is a small Qwen2-like decoder whose every layer has TWO
pathways with the same shapes: the "understanding" weights (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``q_norm``, ``k_norm``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp``) used by text and special tokens,
and the "generation" weights (the same names with ``_moe_gen``) used by latent tokens. Each token is projected
by its own pathway, then ALL tokens attend jointly (one bidirectional attention over the whole sequence, with a
key-padding mask), then each token goes through its own pathway's output projection and MLP. The sequence is::

    [text tokens (L)] [<soi> cond-latent tokens (N) <eoi>]?  [<soi> noisy-latent tokens (N) <eoi>]

(``<soi>``/``<eoi>``: the start/end-of-image token ids of the vocabulary, text pathway; the condition-image block
only when ``cond_latents`` is given, at timestep 0 as BAGEL feeds clean VAE latents.) A latent token is
``vae2llm(patch) + time_embedder(t) + latent_pos_embed(row, col)``; the velocity is ``llm2vae(norm_moe_gen(h))``
of the noisy-latent tokens, unpatchified. RoPE positions: text ``0 .. L-1``, each image block one shared position
(BAGEL's convention). Attention runs in the dtype of the model's weights (``F.scaled_dot_product_attention`` on the
projected q/k/v, never upcast here).

Checkpoints: ``BAGEL_KEY_MAP`` maps BAGEL's ``ema.safetensors`` names to ours by prefix (ours drop the
``language_model.model.`` prefix); keys under ``BAGEL_IGNORED_PREFIXES`` (the ViT understanding tower, which this
denoiser does not have) are skipped. ``load_bagel_checkpoint`` / ``save_bagel_checkpoint`` round-trip.

The adapter follows BAGEL's own sampler (``Bagel.generate_image`` / ``_forward_flow``, its inferencer's defaults):

* schedule: ``t = linspace(1, 0, N + 1)`` shifted by ``t' = s t / (1 + (s - 1) t)`` (``timestep_shift`` s = 3),
  built by ``make_schedule`` (diffusers' static shift is the same formula) from those unshifted sigmas;
* CFG branches that share one layout and differ only in masks: ``full`` (text and condition image), ``cfg_text``
  (the text hidden, the condition image KEPT: BAGEL's text-free context still holds the image), ``cfg_img`` (the
  image hidden, the text kept; only with a condition image), run as one batch;
* their combination, its renormalisation and its interval gating as ``bagel_guidance`` states.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file, save_file
from torch import nn

from runtime.flowgrpo.nondiffusers import NonDiffusersModelBase
from runtime.flowgrpo.registry import VelocityAdapter, register_diffusion_model
from runtime.flowgrpo.scheduler import FlowMatchSchedule, SdeMethod, make_schedule

__all__ = [
    "BagelMoT",
    "BagelMoTFlowGRPO",
    "BAGEL_KEY_MAP",
    "BAGEL_IGNORED_PREFIXES",
    "BAGEL_SPECIAL_TOKENS",
    "BAGEL_WEIGHTS_NAME",
    "bagel_new_token_ids",
    "bagel_prompt_ids",
    "bagel_guidance",
    "bagel_sigmas",
    "from_bagel_keys",
    "to_bagel_keys",
    "load_bagel_checkpoint",
    "save_bagel_checkpoint",
    "save_tiny_bagel",
]

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


# ---------------------------------------------------------------------------------------------- checkpoints
BAGEL_WEIGHTS_NAME = "ema.safetensors"
# BAGEL's tokenizer gains these four special tokens (its ``add_special_tokens``); ``new_token_ids`` names them.
BAGEL_SPECIAL_TOKENS = {
    "bos_token_id": "<|im_start|>",
    "eos_token_id": "<|im_end|>",
    "start_of_image": "<|vision_start|>",
    "end_of_image": "<|vision_end|>",
}


def bagel_new_token_ids(tokenizer: Any) -> dict[str, int]:
    """BAGEL's ``new_token_ids`` of ``tokenizer``: the ids of its four special tokens (``KeyError`` naming a missing
    one)."""
    ids = {}
    for key, token in BAGEL_SPECIAL_TOKENS.items():
        value = tokenizer.convert_tokens_to_ids(token)
        if value is None or value == tokenizer.unk_token_id:
            raise KeyError(f"the tokenizer has no {token} token (BAGEL's {key})")
        ids[key] = int(value)
    return ids


def bagel_prompt_ids(tokenizer: Any, prompt: str, new_token_ids: Mapping[str, int]) -> list[int]:
    """A prompt's token ids as BAGEL's ``prepare_prompts`` makes them: ``[bos] + tokenizer.encode(prompt) + [eos]``."""
    return [new_token_ids["bos_token_id"], *tokenizer.encode(prompt), new_token_ids["eos_token_id"]]


# (checkpoint prefix, our prefix); the first matching checkpoint prefix wins, so longer prefixes come first.
BAGEL_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("language_model.model.embed_tokens.", "embed_tokens."),
    ("language_model.model.layers.", "layers."),
    ("language_model.model.norm_moe_gen.", "norm_moe_gen."),
    ("language_model.model.norm.", "norm."),
    ("language_model.lm_head.", "lm_head."),
    ("time_embedder.", "time_embedder."),
    ("vae2llm.", "vae2llm."),
    ("llm2vae.", "llm2vae."),
    ("latent_pos_embed.", "latent_pos_embed."),
)
BAGEL_IGNORED_PREFIXES: tuple[str, ...] = ("vit_model.", "connector.", "vit_pos_embed.")


def _swap_prefix(key: str, table: Sequence[tuple[str, str]]) -> str | None:
    for src, dst in table:
        if key.startswith(src):
            return dst + key[len(src) :]
    return None


def from_bagel_keys(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """BAGEL checkpoint names -> ours; returns ``(mapped, unmapped keys)`` (ignored prefixes are neither)."""
    out, unmapped = {}, []
    for key, value in state.items():
        if key.startswith(BAGEL_IGNORED_PREFIXES):
            continue
        new = _swap_prefix(key, BAGEL_KEY_MAP)
        if new is None:
            unmapped.append(key)
        else:
            out[new] = value
    return out, unmapped


def to_bagel_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> BAGEL checkpoint names (the inverse of ``from_bagel_keys``); raises on an unmappable key."""
    inverse = tuple(sorted(((d, s) for s, d in BAGEL_KEY_MAP), key=lambda kv: -len(kv[0])))
    out = {}
    for key, value in state.items():
        new = _swap_prefix(key, inverse)
        if new is None:
            raise KeyError(f"no BAGEL checkpoint name for {key!r}")
        out[new] = value
    return out


def save_bagel_checkpoint(model: BagelMoT, path: str, merge_adapters: bool = False) -> None:
    """The base weights (LoRA merged or left out) under BAGEL's names, as one safetensors file."""
    save_file(to_bagel_keys(model.base_state_dict(merge_adapters)), path, metadata={"format": "pt"})


def load_bagel_checkpoint(model: BagelMoT, path: str, strict: bool = True) -> tuple[list[str], list[str]]:
    """Load an ``ema.safetensors``-style file into ``model`` (before adding adapters); returns ``(missing,
    unexpected)`` in our names / the checkpoint's names; ``strict`` raises when either is non-empty."""
    mapped, unexpected = from_bagel_keys(load_file(path))
    result = model.load_state_dict(mapped, strict=False)
    missing = list(result.missing_keys)
    unexpected = unexpected + list(result.unexpected_keys)
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return missing, unexpected


# ---------------------------------------------------------------------------------------------- guidance
CFG_RENORM_TYPES = ("global", "channel", "text_channel")


def bagel_sigmas(num_inference_steps: int) -> list[float]:
    """BAGEL's unshifted timesteps ``linspace(1, 0, N + 1)`` without the final 0 (``make_schedule`` appends it)."""
    return [1.0 - k / num_inference_steps for k in range(num_inference_steps)]


def bagel_guidance(
    v: torch.Tensor,
    v_cfg_text: torch.Tensor,
    v_cfg_img: torch.Tensor | None,
    sigma: torch.Tensor | float,
    *,
    text_scale: float,
    image_scale: float = 1.0,
    interval: tuple[float, float] = (0.4, 1.0),
    renorm_min: float = 0.0,
    renorm_type: str = "global",
    patch_size: int = 1,
) -> torch.Tensor:
    """BAGEL's 3-branch CFG, per sample (``v``: the full branch; ``v_cfg_text``: the text hidden; ``v_cfg_img``: the
    image hidden, or None without a condition image, where BAGEL's image-free context is the full one).

    Guidance applies where ``interval[0] < sigma <= interval[1]`` (the low edge excluded, as BAGEL) and only when
    ``text_scale > 1`` (BAGEL skips every branch otherwise); elsewhere the result is ``v``. Inside::

        "global" / "channel":
            v_text = v_cfg_text + text_scale (v - v_cfg_text)
            v'     = v_cfg_img + image_scale (v_text - v_cfg_img)        if image_scale > 1, else v_text
            v'    *= clamp(||v|| / (||v'|| + 1e-8), renorm_min, 1)      norms over the sample ("global") or per
                                                                         token over the channels ("channel")
        "text_channel":
            v_text = (v_cfg_text + text_scale (v - v_cfg_text)) * clamp(||v||_c / (||.||_c + 1e-8), renorm_min, 1)
            v'     = v_cfg_img + image_scale (v_text - v_cfg_img)        if image_scale > 1, else v_text

    ``||.||_c`` is the norm over each token's values, as BAGEL's packed tokens carry them: the ``C x p x p`` values of
    a ``patch_size`` p patch of a ``[B, C, H, W]`` latent. Computed in fp32.
    """
    if renorm_type not in CFG_RENORM_TYPES:
        raise ValueError(f"unknown cfg_renorm_type {renorm_type!r}; expected one of {', '.join(CFG_RENORM_TYPES)}")
    v, v_text_free = v.float(), v_cfg_text.float()
    v_image_free = v if v_cfg_img is None else v_cfg_img.float()
    b = v.shape[0]
    shape = (b,) + (1,) * (v.ndim - 1)
    s = torch.as_tensor(sigma, dtype=torch.float32, device=v.device).reshape(-1).expand(b)
    inside = ((s > interval[0]) & (s <= interval[1])).reshape(shape)
    if text_scale <= 1.0:
        return v

    def norm(x: torch.Tensor, channel: bool) -> torch.Tensor:
        """Per token (its C x p x p values) or over the whole sample, broadcastable against ``x``."""
        if not channel:
            return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)
        c, h, w = x.shape[1:]
        p = patch_size
        tokens = x.reshape(b, c, h // p, p, w // p, p)
        n = torch.linalg.vector_norm(tokens, dim=(1, 3, 5), keepdim=True)
        return n.expand_as(tokens).reshape(x.shape)

    v_text = v_text_free + text_scale * (v - v_text_free)
    if renorm_type == "text_channel":
        v_text = v_text * (norm(v, True) / (norm(v_text, True) + 1e-8)).clamp(min=renorm_min, max=1.0)
        guided = v_image_free + image_scale * (v_text - v_image_free) if image_scale > 1.0 else v_text
    else:
        guided = v_image_free + image_scale * (v_text - v_image_free) if image_scale > 1.0 else v_text
        channel = renorm_type == "channel"
        guided = guided * (norm(v, channel) / (norm(guided, channel) + 1e-8)).clamp(min=renorm_min, max=1.0)
    return torch.where(inside, guided, v)


@register_diffusion_model("BagelMoT", "flowgrpo")
class BagelMoTFlowGRPO(VelocityAdapter):
    """Batch keys: ``input_ids`` ``[B, L]`` long (``bagel_prompt_ids``: BAGEL's bos/eos around the prompt's tokens),
    optional ``attention_mask`` ``[B, L]``, optional ``cond_latents`` ``[B, C, H, W]`` (a clean condition-image
    latent: the image branch). Defaults are BAGEL's inferencer's."""

    module_class: ClassVar[type] = BagelMoT

    def __init__(
        self,
        *,
        timestep_shift: float = 3.0,
        text_guidance_scale: float = 4.0,
        image_guidance_scale: float = 1.5,
        cfg_interval: tuple[float, float] = (0.4, 1.0),
        cfg_renorm_min: float = 0.0,
        cfg_renorm_type: str = "global",
        noise_level: float = 0.7,
        method: SdeMethod = "sde",
    ):
        if cfg_renorm_type not in CFG_RENORM_TYPES:
            raise ValueError(f"unknown cfg_renorm_type {cfg_renorm_type!r}; expected one of {CFG_RENORM_TYPES}")
        self.timestep_shift = float(timestep_shift)
        self.text_guidance_scale = text_guidance_scale
        self.image_guidance_scale = image_guidance_scale
        self.cfg_interval = tuple(cfg_interval)
        self.cfg_renorm_min = cfg_renorm_min
        self.cfg_renorm_type = cfg_renorm_type
        self.noise_level = noise_level
        self.method: SdeMethod = method

    @property
    def do_cfg(self) -> bool:
        return self.text_guidance_scale > 1.0

    # ---- sampling from prompts (the RL job): BAGEL's tokenization, the VAE -----------------------------------------

    def bind(self, tokenizer: Any, vae: Any, latent_shape: Sequence[int]) -> BagelMoTFlowGRPO:
        """Attach what sampling from prompts needs: the checkpoint's tokenizer (with BAGEL's special tokens), its VAE
        (a diffusers ``AutoencoderKL``: latents are ``(z - shift_factor) * scaling_factor``) and one sample's latent
        shape ``(C, H, W)``."""
        self.tokenizer, self.vae, self.latent_shape = tokenizer, vae, tuple(latent_shape)
        self.new_token_ids = bagel_new_token_ids(tokenizer)
        return self

    def encode(self, prompts: Sequence[str], negative_prompt: str | None = None) -> dict[str, Any]:
        """``input_ids`` (``bagel_prompt_ids`` of each prompt, right-padded) and ``attention_mask``. BAGEL's
        text-free branch hides the text (no negative prompt)."""
        rows = [bagel_prompt_ids(self.tokenizer, p, self.new_token_ids) for p in prompts]
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), self.new_token_ids["eos_token_id"], dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = True
        return {"input_ids": ids, "attention_mask": mask}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of final latents."""
        config = self.vae.config
        x = latents.float() / config.scaling_factor + (config.shift_factor or 0.0)
        device = next(self.vae.parameters()).device
        return self.vae.decode(x.to(device, self.vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    def build_module(self, config: Mapping[str, Any]) -> BagelMoT:
        return BagelMoT(dict(config))

    def build_scheduler(self, config: Mapping[str, Any] | None = None) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(dict(config or {"shift": self.timestep_shift}))

    def set_timesteps(self, num_inference_steps: int, **kwargs: Any) -> FlowMatchSchedule:
        """BAGEL's schedule: ``linspace(1, 0, N + 1)`` with its time shift (see the module docstring)."""
        sigmas = bagel_sigmas(num_inference_steps)
        return make_schedule(self.build_scheduler(), num_inference_steps, sigmas=sigmas, **kwargs)

    def _sigma(self, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(step_index, dtype=torch.long, device=latents.device)
        sigma = batch["schedule"].sigmas.to(latents.device)[index]
        return sigma.expand(latents.shape[0]) if sigma.ndim == 0 else sigma

    def _image_branch(self, batch: dict[str, Any]) -> bool:
        return batch.get("cond_latents") is not None and self.image_guidance_scale > 1.0

    def prepare_model_inputs(
        self, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> dict[str, Any]:
        """Rows ``[cfg_text; cfg_img; full]`` (``cfg_img`` only with a condition image and an image scale > 1), or
        the full branch alone without CFG. All branches share one layout; the masks hide the text / the image."""
        b = latents.shape[0]
        ids = batch["input_ids"]
        text_mask = batch.get("attention_mask")
        text_mask = torch.ones_like(ids, dtype=torch.bool) if text_mask is None else text_mask.bool()
        cond = batch.get("cond_latents")
        sigma = self._sigma(batch, latents, step_index)
        has_img = cond is not None
        yes = torch.ones(b, dtype=torch.bool, device=latents.device)
        branches = [(text_mask, yes)]
        if self.do_cfg:
            branches = [(torch.zeros_like(text_mask), yes)]  # cfg_text: the text hidden, the image kept
            if self._image_branch(batch):
                branches.append((text_mask, ~yes))  # cfg_img: the image hidden
            branches.append((text_mask, yes))
        k = len(branches)
        return {
            "input_ids": ids.repeat(k, 1),
            "latents": latents.repeat(k, *([1] * (latents.ndim - 1))),
            "timestep": sigma.repeat(k),
            "text_mask": torch.cat([m for m, _ in branches]),
            "cond_latents": None if not has_img else cond.repeat(k, *([1] * (cond.ndim - 1))),
            "cond_mask": None if not has_img else torch.cat([c for _, c in branches]),
        }

    def velocity(
        self, module: nn.Module, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> torch.Tensor:
        out = module(**self.prepare_model_inputs(batch, latents, step_index))
        if not self.do_cfg:
            return out
        chunks = out.chunk(3 if self._image_branch(batch) else 2)
        return bagel_guidance(
            chunks[-1],
            chunks[0],
            chunks[1] if len(chunks) == 3 else None,
            self._sigma(batch, latents, step_index),
            text_scale=self.text_guidance_scale,
            image_scale=self.image_guidance_scale,
            interval=self.cfg_interval,
            renorm_min=self.cfg_renorm_min,
            renorm_type=self.cfg_renorm_type,
            patch_size=int(getattr(module, "config", {}).get("latent_patch_size", 1)),
        )


def save_tiny_bagel(directory: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random BAGEL-style checkpoint directory, for tests and demos (no download): ``config.json``,
    ``ema.safetensors`` under BAGEL's names, a tokenizer with BAGEL's four special tokens, and ``vae/`` (a tiny
    ``AutoencoderKL`` with 4 latent channels and BAGEL's FLUX-VAE normalisation, x8 downsampling)."""
    from diffusers import AutoencoderKL

    from runtime.diffusion.tiny import tiny_tokenizer

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
