"""Shared pieces of the fidelity suite: which models it covers, upstream/generated pairs, ragged batches, and an
exact comparison that reports every scenario that differs.

The suite is driven by the registry: every spec whose `[model]` family is `causal_lm`, `vlm` or `omni` joins it
(DiT models are diffusers classes with their own tests). A model with the `vision` capability is also run with an
image in (most of) its samples; every model runs text-only rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.models.registry import GeneratedModel, lookup, model_types
from runtime.models.tiny_configs import random_vlm_batch, tiny_config

FAMILIES = ("causal_lm", "vlm", "omni")
MODELS = [model_type for family in FAMILIES for model_type in model_types(family)]
ATTENTION = ("eager", "sdpa")  # the attention implementations available on CPU
BATCH_SIZES = (1, 2, 3, 4, 5)
PAD_ID = 0
IGNORE = -100
# (t, h, w) patch grids cycled over a batch's images: 4, 2 and 2 LM tokens after the 2x2 merge
GRIDS = ((1, 4, 4), (1, 2, 4), (1, 4, 2))


def kinds(model_type: str) -> tuple[str, ...]:
    """Input kinds a model is run with: text rows, and rows with images when it has a vision tower."""
    return ("text", "image") if lookup(model_type).has("vision") else ("text",)


@dataclass
class Pair:
    """An upstream model and the generated one with identical weights (fp32, one attention implementation)."""

    entry: GeneratedModel
    attn: str
    upstream: Any
    generated: Any
    config: Any = field(repr=False)

    @property
    def models(self) -> tuple[Any, Any]:
        return self.upstream, self.generated

    def forward_kwargs(self) -> dict[str, Any]:
        """MoE: upstream adds the load-balancing loss (and routes its gradient) only when asked per call."""
        return {"output_router_logits": True} if self.entry.is_moe else {}


def make_pair(model_type: str, attn: str, seed: int = 0) -> Pair:
    """Both built the way transformers builds a model from a config (`_from_config`), then the generated model
    takes the upstream weights (strict: same parameter and buffer names)."""
    entry = lookup(model_type)
    torch.manual_seed(seed)
    upstream = entry.upstream_class().from_config(tiny_config(model_type), attn_implementation=attn)
    generated = entry.model_class()._from_config(tiny_config(model_type), attn_implementation=attn)
    generated.load_state_dict(upstream.state_dict())
    if type(generated).__module__ != entry.module:
        raise AssertionError(f"{model_type}: {type(generated).__module__} is not the generated module {entry.module}")
    return Pair(entry, attn, upstream, generated, tiny_config(model_type))


def _sample(pair: Pair, index: int, image: bool, seed: int) -> dict[str, torch.Tensor]:
    """One unpadded sample (batch dim 1). Lengths vary with `index`; with `image`, sample 1 (of 3) has none."""
    config = pair.config
    if pair.entry.family == "causal_lm":
        n = 5 + (3 * index) % 5
        ids = torch.randint(1, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": ids.clone()}
    if image and index % 3 != 1:
        grid = GRIDS[index % len(GRIDS)]
        return random_vlm_batch((grid,), (2 + index % 3, 3 + (2 * index) % 4), config, seed)
    return random_vlm_batch((), (5 + (3 * index) % 5,), config, seed)


def ragged_batch(
    pair: Pair, batch_size: int, side: str, image: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """`batch_size` samples of different lengths padded on `side` ("left" or "right") with an attention mask, as a
    tokenizer/processor pads them: pad tokens carry id 0, label -100 and text type 0. Image samples' pixels and
    grids are concatenated in sample order."""
    samples = [_sample(pair, i, image, seed * 100 + i) for i in range(batch_size)]
    width = max(s["input_ids"].shape[1] for s in samples)
    fill = {"input_ids": PAD_ID, "labels": IGNORE, "mm_token_type_ids": 0, "attention_mask": 0}
    rows: dict[str, list[torch.Tensor]] = {key: [] for key in fill}
    for s in samples:
        s = dict(s, attention_mask=torch.ones_like(s["input_ids"]))
        pad = width - s["input_ids"].shape[1]
        for key in fill:
            if key not in s:
                continue
            padding = torch.full((1, pad), fill[key], dtype=s[key].dtype)
            rows[key].append(torch.cat([padding, s[key]] if side == "left" else [s[key], padding], 1))
    batch = {key: torch.cat(parts) for key, parts in rows.items() if parts}
    for key in ("pixel_values", "image_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            batch[key] = torch.cat(parts)
    accepted = inspect.signature(pair.upstream.forward).parameters
    return {key: value for key, value in batch.items() if key in accepted}  # e.g. omni takes no mm_token_type_ids


def diff(a: Any, b: Any) -> str | None:
    """None when `a` and `b` are bitwise equal (NaN equal to NaN, same dtype and shape); else what differs."""
    if a is None or b is None:
        return None if a is None and b is None else f"{type(a).__name__} vs {type(b).__name__}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    same_nan = torch.isnan(a) == torch.isnan(b) if a.is_floating_point() else torch.ones_like(a, dtype=torch.bool)
    if bool(same_nan.all()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
        return None
    if a.is_floating_point():
        return f"max |diff| {(a.double() - b.double()).abs().nan_to_num(float('inf')).max().item():.3g}"
    return f"{int((a != b).sum())} of {a.numel()} entries differ"


class Mismatches:
    """Collects every scenario whose upstream and generated values differ, so one failure lists them all."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        self.found: list[str] = []

    def check(self, scenario: str, what: str, upstream: Any, generated: Any) -> None:
        why = diff(upstream, generated)
        if why is not None:
            self.found.append(f"{scenario}: {what}: {why}")

    def assert_none(self) -> None:
        shown = "\n  ".join(self.found[:40])
        more = f"\n  (+{len(self.found) - 40} more)" if len(self.found) > 40 else ""
        assert not self.found, (
            f"{self.model_type}: generated != upstream in {len(self.found)} checks:\n  {shown}{more}"
        )
