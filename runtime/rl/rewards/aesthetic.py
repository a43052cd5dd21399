"""The LAION aesthetic predictor: a linear head on the L2-normalised CLIP image embedding (the "improved aesthetic
predictor" flow_grpo's and DDPO's ``aesthetic_score`` use; about 1-10, higher is prettier).

Checkpoint: a CLIP directory saved by transformers (``openai/clip-vit-large-patch14`` for the real predictor) and the
head's weights (``head``: a ``.safetensors`` file, or the predictor's released ``.pth`` state dict read with
``torch.load(weights_only=True)``, e.g. ``sac+logos+ava1-l14-linearMSE.pth``). The released head is
``Linear(768, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout, Linear(64, 16), Linear(16, 1)``
under ``layers.{0,2,4,6,7}``: no activation between the layers (the predictor's authors left them out), so the score
is one affine map of the embedding; dropout is off at scoring time. The head is built from the file's shapes, so a
tiny CLIP with a tiny head loads through the same code.

Score per sample: ``head(e / |e|)`` with ``e = CLIP.get_image_features(pixels)``, the image through the CLIP
checkpoint's own image processor as 8-bit RGB; a video's frames are scored one by one and averaged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch
from torch import nn

__all__ = ["AestheticReward", "linear_head", "load_head_state"]

_LAYER_KEY = re.compile(r"^(?:layers\.)?(\d+)\.(weight|bias)$")


def load_head_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The head's state dict from a ``.safetensors`` file or a weights-only ``torch.load`` of a ``.pth``."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def linear_head(state: dict[str, torch.Tensor]) -> nn.Sequential:
    """The stack of ``Linear`` layers the state dict holds under ``layers.<i>`` (in index order), with its weights;
    the dropout slots between them are identities (scoring only)."""
    indices = sorted({int(m.group(1)) for key in state if (m := _LAYER_KEY.match(key))})
    if not indices or any(not _LAYER_KEY.match(key) for key in state):
        raise ValueError(f"expected only layers.<i>.weight / .bias keys, found {sorted(state)[:6]}")
    modules: list[nn.Module] = []
    for index in range(indices[-1] + 1):
        weight = state.get(f"layers.{index}.weight", state.get(f"{index}.weight"))
        if weight is None:
            modules.append(nn.Identity())
            continue
        bias = state.get(f"layers.{index}.bias", state.get(f"{index}.bias"))
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
        modules.append(layer)
    head = nn.Sequential(*modules).eval()
    if head[-1].out_features != 1:
        raise ValueError(f"the head's last layer gives {head[-1].out_features} values, not 1 score")
    return head


class AestheticReward:
    """``head(normalise(CLIP image embedding))`` per sample."""

    def __init__(self, model: Any, image_processor: Any, head: nn.Sequential, batch_size: int = 32) -> None:
        self.model, self.image_processor, self.head, self.batch_size = model.eval(), image_processor, head, batch_size

    @classmethod
    def from_pretrained(cls, path: str, head: str, batch_size: int = 32) -> AestheticReward:
        from transformers import CLIPImageProcessor, CLIPModel

        return cls(
            CLIPModel.from_pretrained(path),
            CLIPImageProcessor.from_pretrained(path),
            linear_head(load_head_state(head)),
            batch_size,
        )

    @torch.no_grad()
    def _scores(self, images: list[PIL.Image.Image]) -> torch.Tensor:
        from runtime.rl.rewards.models import _embedding

        device = next(self.model.parameters()).device
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"].to(device)
        embedding = _embedding(self.model.get_image_features(pixel_values=pixels)).float()
        embedding = embedding / embedding.norm(dim=-1, keepdim=True)
        return self.head.to(device)(embedding).squeeze(-1).cpu()

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from runtime.rl.rewards.http import to_uint8

        frames = samples.unbind(2) if samples.ndim == 5 else (samples,)
        per_frame = []
        for frame in frames:
            images = [PIL.Image.fromarray(to_uint8(x)) for x in frame]
            per_frame.append(
                torch.cat(
                    [self._scores(images[i : i + self.batch_size]) for i in range(0, len(images), self.batch_size)]
                )
            )
        return torch.stack(per_frame).mean(dim=0)
