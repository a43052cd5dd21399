"""Offline preference pairs (Diffusion-DPO's data): a JSONL file, one pair a line::

    {"prompt": "a red kite", "chosen": "img/kite_good.png", "rejected": "img/kite_bad.jpg"}

``chosen`` and ``rejected`` are image files (PNG or JPEG, read with PIL), relative to the JSONL file's directory and
inside it (``runtime/data/media_paths.py``: the data rule of every family). Image models only: a pair of videos is
not a format here (``runtime/rl/algorithms/dpo.py`` refuses video models in the config). Every line is checked when
the file is read (object shape, paths, each image's header), so a bad line stops the run before the model is built,
with one error ``file:line: ...``.

Which pairs each replica takes at each iteration: ``runtime.rl.prompts.PromptSampler`` over the pairs (seeded,
rank-sharded, resumable: the same guarantees as for prompts). Pixels: ``runtime.data.dit.media.to_pixels`` (resize
to cover, centre-crop, [-1, 1]) and latents: the condition model's ``encode_sample`` (the model's own VAE and
normalization), the DiT trainer's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data.errors import LineError
from runtime.data.jsonl import read_records
from runtime.data.media_paths import MediaRoot
from runtime.rl.prompts import MAX_PROMPT_CHARS
from runtime.train.config import ConfigError

__all__ = ["IMAGE_SUFFIXES", "Pair", "encode_images", "read_pairs"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
EXAMPLE = '{"prompt": "a red kite", "chosen": "a.png", "rejected": "b.png"}'


@dataclass(frozen=True)
class Pair:
    text: str  # the prompt (``text`` as in ``Prompt``)
    chosen: Path
    rejected: Path
    where: str  # file:line


def _image(root: MediaRoot, record: dict, key: str) -> Path:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise LineError(f'"{key}": expected an image path (a string), e.g. {EXAMPLE}')
    path = root.resolve(value, key)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise LineError(f'"{key}": {value!r} is not a PNG or JPEG file ({", ".join(IMAGE_SUFFIXES)})')
    if not path.is_file():
        raise LineError(f'"{key}": {value!r}: no such file (paths are relative to {root.directory})')
    from PIL import Image

    try:
        with Image.open(path) as image:  # the header only: a truncated or foreign file is refused here
            image.verify()
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
        raise LineError(f'"{key}": cannot read image {value!r}: {exc}') from None
    return path


def _pair(root: MediaRoot, record: Any, where: str) -> Pair:
    if not isinstance(record, dict):
        raise LineError(f"expected an object such as {EXAMPLE}")
    unknown = sorted(set(record) - {"prompt", "chosen", "rejected"})
    if unknown:
        raise LineError(f"unknown key {unknown[0]!r}; a pair has prompt, chosen and rejected, e.g. {EXAMPLE}")
    text = record.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise LineError(f'"prompt": expected a non-empty string, e.g. {EXAMPLE}')
    if len(text) > MAX_PROMPT_CHARS:
        raise LineError(f'"prompt": {len(text)} characters; at most {MAX_PROMPT_CHARS}')
    chosen, rejected = _image(root, record, "chosen"), _image(root, record, "rejected")
    if chosen.resolve() == rejected.resolve():
        raise LineError('"chosen" and "rejected" are the same file: a pair needs two different images')
    return Pair(text, chosen, rejected, where)


def read_pairs(path: str | Path) -> list[Pair]:
    """Every pair of the JSONL file ``path`` in file order; ``ValueError`` naming the file (and line) otherwise."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: expected a .jsonl file, one pair a line: {EXAMPLE}")
    if not path.is_file():
        raise ValueError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    root = MediaRoot.of(path)
    pairs = read_records(path, lambda record, where: _pair(root, record, where))
    if not pairs:
        raise ValueError(f"{path}: holds no pair")
    return pairs


def encode_images(condition_model: Any, paths: list[Path], wheres: list[str], height: int, width: int) -> Any:
    """The normalized latents ``[N, ...]`` of the images ``paths`` at ``height x width`` (the model's VAE)."""
    import torch
    from PIL import Image

    from runtime.data.dit.media import to_pixels

    out = []
    for path, where in zip(paths, wheres, strict=True):
        try:
            with Image.open(path) as image:
                frame = image.convert("RGB")
        except Exception as exc:  # changed on disk since the check
            raise ConfigError(f"{where}: cannot read image {path}: {exc}") from None
        out.append(condition_model.encode_sample(to_pixels([frame], height, width, video=False)))
    return torch.stack(out)
