"""The DiT data file: JSONL of (caption, image or video) pairs on local disk.

One JSON object per line::

    {"caption": "a red ball bouncing", "video": "clips/ball.mp4"}      # a video file (decoded with PyAV)
    {"caption": "a red ball bouncing", "video": "clips/ball_frames/"}  # a folder of frame images, in name order
    {"caption": "a red ball bouncing", "video": ["f0.png", "f1.png"]}  # the frames listed one by one
    {"caption": "a lighthouse at dusk", "image": "img/lighthouse.jpg"} # an image (PIL)

Paths are relative to the JSONL file and must stay inside its directory, a frame folder's frames too
(``runtime/data/media_paths.py``; ``data.media_dir`` names another root). Other keys are ignored. Parsing is strict
and stops at the first bad line with ``file:line`` and what was expected: a skipped or misread line would only show
up much later as a worse model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runtime.data.errors import LineError
from runtime.data.media_paths import MediaRoot
from runtime.data.records import read_records

__all__ = ["IMAGE_SUFFIXES", "MediaSample", "frame_files", "read_media_jsonl"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


@dataclass(frozen=True)
class MediaSample:
    """One training sample: where it was read (``file:line``), its caption and its media files."""

    where: str
    caption: str
    kind: Literal["image", "video", "frames"]  # an image file, a video file, or a video given as frame images
    files: tuple[Path, ...]  # image: one file; video: one file; frames: the frames in order

    @property
    def is_video(self) -> bool:
        return self.kind != "image"


def _natural_key(path: Path) -> list[Any]:
    """``frame_2`` before ``frame_10``: numbers compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def frame_files(directory: Path) -> tuple[Path, ...]:
    """The image files of a frame folder, in natural name order."""
    return tuple(sorted((p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES), key=_natural_key))


def _path(value: Any, key: str, base: MediaRoot) -> Path:
    if not isinstance(value, str) or not value:
        raise LineError(f"{key!r} must be a non-empty path string, got {value!r:.60}")
    return base.resolve(value, key)


def _existing_file(value: Any, key: str, base: MediaRoot) -> Path:
    path = _path(value, key, base)
    if not path.is_file():
        raise LineError(f"{key}: file not found: {path}")
    return path


def _video(value: Any, base: MediaRoot) -> tuple[str, tuple[Path, ...]]:
    if isinstance(value, list):
        if not value:
            raise LineError("'video' as a list must name at least one frame image")
        return "frames", tuple(_existing_file(v, f"video[{i}]", base) for i, v in enumerate(value))
    path = _path(value, "video", base)
    if path.is_dir():
        frames = frame_files(path)
        if not frames:
            raise LineError(f"video: the frame folder {path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        for frame in frames:  # a symlinked frame must stay inside too
            base.check_inside(frame, "video", f"{value.rstrip('/')}/{frame.name}")
        return "frames", frames
    if not path.is_file():
        raise LineError(f"video: file or frame folder not found: {path}")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        raise LineError(f"video: {path} is an image; use the 'image' key (or a folder / list of frames)")
    return "video", (path,)


def parse_media_record(record: Any, base: MediaRoot, where: str) -> MediaSample:
    if not isinstance(record, dict):
        raise LineError(f'expected an object {{"caption": ..., "image" or "video": ...}}, got {type(record).__name__}')
    caption = record.get("caption")
    if not isinstance(caption, str):
        raise LineError(f"'caption' must be a string, got {caption!r:.60}")
    has_image, has_video = "image" in record, "video" in record
    if has_image == has_video:
        raise LineError(
            f"expected exactly one of the keys 'image' or 'video', found {'both' if has_image else 'neither'}"
        )
    if has_image:
        return MediaSample(where, caption, "image", (_existing_file(record["image"], "image", base),))
    kind, files = _video(record["video"], base)
    return MediaSample(where, caption, kind, files)


def read_media_jsonl(path: str | Path, media_dir: str | Path | None = None) -> list[MediaSample]:
    """Every sample of a DiT data file in file order (blank lines skipped); ValueError naming ``file:line``. Media
    paths resolve against the file's directory (``media_dir`` when given) and must stay inside it."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise ValueError(
            f"{path}: a DiT data file must end in .jsonl (one JSON sample per line), found "
            f"{path.suffix or 'no suffix'!r}; rename it if it is one"
        )
    base = MediaRoot.of(path, media_dir)
    return read_records(path, lambda record, where: parse_media_record(record, base, where))
