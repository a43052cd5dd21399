"""Model-based rewards loaded from a local directory with transformers: a CLIP image-text score and a preference
score (PickScore: CLIP fine-tuned on human preferences, its score is the model's logit scale times the cosine).

Both read a ``CLIPModel`` checkpoint directory (``from_pretrained``; nothing is downloaded: ``HF_HUB_OFFLINE`` or a
local path) and its tokenizer and image processor from ``processor`` (default: the same directory). Real ones:

* ``clip``: ``openai/clip-vit-large-patch14`` (tokenizer and processor in the same repository);
* ``pickscore``: ``yuvalkirstain/PickScore_v1`` with ``processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K``.

Scores, per sample (a video's frames are scored one by one and averaged):

* ``clip``: ``cos(image_embedding, text_embedding)`` in [-1, 1];
* ``pickscore``: ``exp(logit_scale) * cos(...)`` (PickScore's own definition; about 20-23 for real images).

Images are scored as the 8-bit RGB images a pipeline would output (``runtime/rl/rewards/http.py`` ``to_uint8``),
through the checkpoint's own image processor, in batches of ``batch_size`` (default 32) images.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

__all__ = ["ClipReward", "save_tiny_clip"]


def _embedding(output: Any) -> torch.Tensor:
    """transformers 5 returns a model output from ``get_*_features``; earlier versions a tensor."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipReward:
    """``clip`` (cosine) or ``pickscore`` (logit scale x cosine) of a CLIP checkpoint."""

    def __init__(self, model: Any, tokenizer: Any, image_processor: Any, kind: str, batch_size: int = 32) -> None:
        self.model, self.tokenizer, self.image_processor = model.eval(), tokenizer, image_processor
        self.kind, self.batch_size = kind, batch_size

    @classmethod
    def from_pretrained(cls, path: str, kind: str, processor: str | None = None, batch_size: int = 32) -> ClipReward:
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

        source = processor or path
        model = CLIPModel.from_pretrained(path)
        return cls(
            model, AutoTokenizer.from_pretrained(source), CLIPImageProcessor.from_pretrained(source), kind, batch_size
        )

    @torch.no_grad()
    def _scores(self, images: list[PIL.Image.Image], texts: list[str]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"].to(device)
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
        image = _embedding(self.model.get_image_features(pixel_values=pixels))
        text = _embedding(self.model.get_text_features(**tokens))
        cos = torch.nn.functional.cosine_similarity(image.float(), text.float(), dim=-1)
        return cos * self.model.logit_scale.exp().float() if self.kind == "pickscore" else cos

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from runtime.rl.rewards.http import to_uint8

        frames = samples.unbind(2) if samples.ndim == 5 else (samples,)  # videos: every frame, averaged
        per_frame = []
        for frame in frames:
            images = [PIL.Image.fromarray(to_uint8(x)) for x in frame]
            chunks = [
                self._scores(images[i : i + self.batch_size], list(prompts[i : i + self.batch_size]))
                for i in range(0, len(images), self.batch_size)
            ]
            per_frame.append(torch.cat(chunks).cpu())
        return torch.stack(per_frame).mean(dim=0)


def save_tiny_clip(directory: str | Path, seed: int = 0) -> Path:
    """A tiny random CLIP checkpoint (model, tokenizer, image processor for 32 px) saved with transformers, for tests,
    demos and benchmarks: the reward loads it through the same code as a real one. No download."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from runtime.diffusion.tiny_pipelines import tiny_tokenizer

    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    layers = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={
            **layers,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={**layers, "image_size": 32, "patch_size": 8},
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory
