"""Images in the start-up self-check's rows of vision-language models (``self_check_text.py`` builds the rows):
every even data-parallel replica's row ends with one sample holding an image, so the proof runs the ViT's SP
pad-and-slice, the fill-back into the language model's tokens and (qwen3_vl) the deepstack levels, while an odd
replica (dp > 1) has none and runs the tower's FSDP dummy forward. The sample is laid out as the data path lays it out
(``random_vlm_batch``: vision start, image tokens, vision end), its M-RoPE ids from the model's own
``get_rope_index`` with the text row first, ``(4, 1, L)``; its first token is nobody's target (a packed document)."""

from __future__ import annotations

from typing import Any

import torch

from runtime.models.tiny_configs import random_vlm_batch

__all__ = ["VISION_KEYS", "GRID", "concatenated", "with_image"]

GRID = (1, 4, 6)  # temporal x height x width patches: 6 language-model tokens after the 2x2 merge
TEXT_AROUND = (5, 4)  # text tokens before and after the image
VISION_KEYS = ("pixel_values", "image_grid_thw")  # whole on every SP rank; concatenated along the image dim


def with_image(
    row: dict[str, torch.Tensor], config: Any, model: torch.nn.Module, seed: int
) -> dict[str, torch.Tensor]:
    """``row`` (a text-only multimodal row) followed by one image sample."""
    sample = random_vlm_batch((GRID,), TEXT_AROUND, config, seed)
    mrope, _ = model.model.get_rope_index(sample["input_ids"], sample["mm_token_type_ids"], sample["image_grid_thw"])
    text = torch.arange(sample["input_ids"].shape[1])[None, None]
    sample["position_ids"] = torch.cat([text, mrope], dim=0)
    sample["labels"][:, 0] = -100  # a document's first token is nobody's target
    out = {key: torch.cat([row[key], sample[key].to(row[key].dtype)], dim=-1) for key in row}
    out.update({key: sample[key] for key in VISION_KEYS})
    return out


def concatenated(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every replica's row as one packed row (the one-process reference): token tensors along the sequence, the
    images of the rows that have some along the image dim, in row order (the order the model scatters them in)."""
    tokens = {key: torch.cat([row[key] for row in rows], dim=-1) for key in rows[0] if key not in VISION_KEYS}
    for key in VISION_KEYS:
        parts = [row[key] for row in rows if key in row]
        if parts:
            tokens[key] = torch.cat(parts, dim=0)
    return tokens
