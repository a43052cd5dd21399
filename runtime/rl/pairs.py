"""Offline preference pairs (Diffusion-DPO's data): a JSONL file, one pair a line::

    {"prompt": "a red kite", "chosen": "img/kite_good.png", "rejected": "img/kite_bad.jpg"}     # an image model
    {"prompt": "a red kite", "chosen": "vid/kite_good.mp4", "rejected": "vid/kite_bad.webm"}   # a video model

``chosen`` and ``rejected`` are files relative to the JSONL file's directory and inside it
(``runtime/data/media_paths.py``: the data rule of every family): images (PNG or JPEG, read with PIL) for an image
model, video files (anything PyAV decodes: ``runtime/data/dit/media.py``, the DiT trainer's reader) for a video model
(Wan, HunyuanVideo). A video model is trained on the first ``sampling.frames`` frames of each video (the rollout's
frame count, ``4k + 1``: the VAE compresses time by 4 after the first frame), so a shorter video is refused rather
than padded. Every line is checked when the file is read (object shape, paths, each image's header, each video's
frame count), so a bad line stops the run before the model is built, with one error ``file:line: ...``.

Which pairs each replica takes at each iteration: ``runtime.rl.prompts.PromptSampler`` over the pairs (seeded,
rank-sharded, resumable: the same guarantees as for prompts). Pixels: ``runtime.data.dit.media.to_pixels`` (resize
to cover, centre-crop, [-1, 1]) and latents: the condition model's ``encode_sample`` (the model's own VAE and
normalization), the DiT trainer's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config.errors import ConfigError
from runtime.data.dit import manifest
from runtime.data.errors import LineError
from runtime.data.media_paths import MediaRoot
from runtime.data.records import read_records
from runtime.rl.prompts import MAX_PROMPT_CHARS

__all__ = ["IMAGE_SUFFIXES", "Pair", "encode_media", "read_pairs"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
EXAMPLE = '{"prompt": "a red kite", "chosen": "a.png", "rejected": "b.png"}'
VIDEO_EXAMPLE = '{"prompt": "a red kite", "chosen": "a.mp4", "rejected": "b.mp4"}'


@dataclass(frozen=True)
class Pair:
    text: str  # the prompt (``text`` as in ``Prompt``)
    chosen: Path
    rejected: Path
    where: str  # file:line


def _video_sample(path: Path, where: str) -> manifest.MediaSample:
    """``path`` as the DiT reader's video sample; its errors start with ``where``."""
    return manifest.MediaSample(where, "", "video", (path,))


def _check_image(path: Path, key: str, value: str) -> None:
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise LineError(
            f'"{key}": {value!r} is not a PNG or JPEG file ({", ".join(IMAGE_SUFFIXES)}); the model generates '
            f"images, so a pair is two images, e.g. {EXAMPLE}"
        )
    from runtime.data.images import ImageTooLarge, open_image

    try:
        with open_image(path) as image:  # the header only: a truncated or foreign file is refused here
            image.verify()
    except ImageTooLarge as exc:
        raise LineError(f'"{key}": cannot read image {exc}') from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
        raise LineError(f'"{key}": cannot read image {value!r}: {exc}') from None


def _check_video(path: Path, key: str, value: str, frames: int) -> None:
    from runtime.data.dit.media import probe

    if path.suffix.lower() in manifest.IMAGE_SUFFIXES:
        raise LineError(
            f'"{key}": {value!r} is an image; the model generates videos, so a pair is two video files, e.g. '
            f"{VIDEO_EXAMPLE}"
        )
    try:
        found = probe(_video_sample(path, f'"{key}"')).frames  # its errors read '"chosen": cannot read video ...'
    except ValueError as exc:
        raise LineError(str(exc)) from None
    if found < frames:
        raise LineError(f'"{key}": {value!r} has {found} frames; the model needs {frames} (sampling.frames)')


def _media(root: MediaRoot, record: dict, key: str, frames: int | None) -> Path:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        kind, example = ("an image", EXAMPLE) if frames is None else ("a video", VIDEO_EXAMPLE)
        raise LineError(f'"{key}": expected {kind} path (a string), e.g. {example}')
    path = root.resolve(value, key)
    if not path.is_file():
        raise LineError(f'"{key}": {value!r}: no such file (paths are relative to {root.directory})')
    if frames is None:
        _check_image(path, key, value)
    else:
        _check_video(path, key, value, frames)
    return path


def _pair(root: MediaRoot, record: Any, where: str, frames: int | None) -> Pair:
    example = EXAMPLE if frames is None else VIDEO_EXAMPLE
    if not isinstance(record, dict):
        raise LineError(f"expected an object such as {example}")
    unknown = sorted(set(record) - {"prompt", "chosen", "rejected"})
    if unknown:
        raise LineError(f"unknown key {unknown[0]!r}; a pair has prompt, chosen and rejected, e.g. {example}")
    text = record.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise LineError(f'"prompt": expected a non-empty string, e.g. {example}')
    if len(text) > MAX_PROMPT_CHARS:
        raise LineError(f'"prompt": {len(text)} characters; at most {MAX_PROMPT_CHARS}')
    chosen, rejected = _media(root, record, "chosen", frames), _media(root, record, "rejected", frames)
    if chosen.resolve() == rejected.resolve():
        raise LineError('"chosen" and "rejected" are the same file: a pair needs two different ones')
    return Pair(text, chosen, rejected, where)


def read_pairs(path: str | Path, frames: int | None = None) -> list[Pair]:
    """Every pair of the JSONL file ``path`` in file order; ``ValueError`` naming the file (and line) otherwise.

    ``frames``: ``None`` for an image model (pairs of images), else the frame count a video model trains on
    (``sampling.frames``): pairs of videos with at least that many frames."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: expected a .jsonl file, one pair a line: {EXAMPLE}")
    if not path.is_file():
        raise ValueError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    root = MediaRoot.of(path)
    pairs = read_records(path, lambda record, where: _pair(root, record, where, frames))
    if not pairs:
        raise ValueError(f"{path}: holds no pair")
    return pairs


def _frames(path: Path, where: str, frames: int | None) -> list[Any]:
    """The image (one frame), or the first ``frames`` frames of the video, as RGB PIL images."""
    if frames is not None:
        from runtime.data.dit.media import load_frames

        try:
            return load_frames(_video_sample(path, where), frames)
        except ValueError as exc:  # changed on disk since the check
            raise ConfigError(str(exc)) from None
    from runtime.data.images import ImageTooLarge, open_image

    try:
        with open_image(path) as image:
            return [image.convert("RGB")]
    except ImageTooLarge as exc:
        raise ConfigError(f"{where}: cannot read image {exc}") from None
    except Exception as exc:  # changed on disk since the check
        raise ConfigError(f"{where}: cannot read image {path}: {exc}") from None


def encode_media(
    condition_model: Any, paths: list[Path], wheres: list[str], height: int, width: int, frames: int | None = None
) -> Any:
    """The normalized latents ``[N, ...]`` (the model's VAE) of the images ``paths`` at ``height x width``, or, with
    ``frames`` (a video model), of the first ``frames`` frames of the videos ``paths``."""
    import torch

    from runtime.data.dit.media import to_pixels

    out = []
    for path, where in zip(paths, wheres, strict=True):
        pixels = to_pixels(_frames(path, where, frames), height, width, video=frames is not None)
        out.append(condition_model.encode_sample(pixels))
    return torch.stack(out)
