"""A small synthetic caption + video/image data set written as real files, for DiT demos and trainer tests.

Each clip is a coloured square gliding across a plain background in one of four directions; its caption says the
colour and the direction ("a red square moving left on a grey background"), so the captions carry information the
model can learn. Clips are written as MP4 files (H.264 through PyAV) or as folders of PNG frames; images are single
frames of the same scenes. Everything is drawn from ``random.Random(seed)``: a seed gives the same pixels.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["JSONL_NAME", "write_synthetic_clips", "write_synthetic_images", "write_video"]

JSONL_NAME = "data.jsonl"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 70, 220), "yellow": (240, 210, 40)}
BACKGROUNDS = {"grey": (128, 128, 128), "white": (245, 245, 245), "black": (15, 15, 15)}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def _scene(rng: random.Random, frames: int, height: int, width: int) -> tuple[str, list[np.ndarray]]:
    colour, background, direction = (
        rng.choice(list(COLOURS)),
        rng.choice(list(BACKGROUNDS)),
        rng.choice(list(DIRECTIONS)),
    )
    side = max(2, min(height, width) // 3)
    dx, dy = DIRECTIONS[direction]
    step = max(1, (min(height, width) - side) // max(1, frames - 1))
    x0 = (width - side) // 2 - dx * step * (frames - 1) // 2
    y0 = (height - side) // 2 - dy * step * (frames - 1) // 2
    out = []
    for t in range(frames):
        image = np.empty((height, width, 3), dtype=np.uint8)
        image[:] = BACKGROUNDS[background]
        x = min(max(0, x0 + dx * step * t), width - side)
        y = min(max(0, y0 + dy * step * t), height - side)
        image[y : y + side, x : x + side] = COLOURS[colour]
        out.append(image)
    return f"a {colour} square moving {direction} on a {background} background", out


def write_video(path: Path, frames: Sequence[np.ndarray], fps: int = 8) -> Path:
    """``frames`` (H, W, 3 uint8) as an H.264 MP4 (PyAV; sizes are rounded up to even by padding the edge)."""
    import av

    height, width = frames[0].shape[:2]
    even_h, even_w = height + height % 2, width + width % 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = even_w, even_h, "yuv420p"
        stream.options = {"crf": "12", "preset": "ultrafast"}
        for frame in frames:
            padded = np.pad(frame, ((0, even_h - height), (0, even_w - width), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(padded, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_synthetic_clips(
    directory: str | Path,
    count: int,
    frames: int,
    height: int,
    width: int,
    seed: int = 0,
    frame_folders_every: int = 0,
) -> Path:
    """``count`` clips and their ``data.jsonl``; every ``frame_folders_every``-th clip (0: none) is written as a
    folder of PNG frames instead of an MP4. Returns the JSONL path."""
    from PIL import Image

    directory = Path(directory)
    (directory / "clips").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        caption, images = _scene(rng, frames, height, width)
        if frame_folders_every and index % frame_folders_every == frame_folders_every - 1:
            folder = directory / "clips" / f"clip_{index:03d}"
            folder.mkdir(exist_ok=True)
            for t, image in enumerate(images):
                Image.fromarray(image).save(folder / f"frame_{t:03d}.png")
            video = f"clips/{folder.name}"
        else:
            video = f"clips/clip_{index:03d}.mp4"
            write_video(directory / video, images)
        lines.append(json.dumps({"caption": caption, "video": video}))
    path = directory / JSONL_NAME
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_synthetic_images(directory: str | Path, count: int, height: int, width: int, seed: int = 0) -> Path:
    """``count`` PNG images (one frame of a scene each) and their ``data.jsonl``. Returns the JSONL path."""
    from PIL import Image

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        caption, images = _scene(rng, 3, height, width)
        name = f"images/image_{index:03d}.png"
        Image.fromarray(images[1]).save(directory / name)
        lines.append(json.dumps({"caption": caption.replace(" moving", ", moving"), "image": name}))
    path = directory / JSONL_NAME
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
