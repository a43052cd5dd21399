"""A small synthetic vision-language chat data set, written to disk, for demos and trainer tests.

Each image is a coloured square on a plain background, so every question has a short, checkable answer. Image sides
are multiples of 8 px (16..32), i.e. whole 2x2 merge groups of 4-px patches, as ``TINY_VISION`` expects. The set
mixes one-image samples with two-image samples (every fourth sample from the third on) and one video (sample 1: a
square changing colour over 4 frames). Everything is drawn from ``random.Random(seed)``, so a seed gives the same
files byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 30),
}
BACKGROUNDS = ((255, 255, 255), (128, 128, 128), (20, 20, 20))
SIZES = ((16, 16), (24, 16), (16, 24), (24, 24), (32, 24), (24, 32), (32, 16))  # (width, height) in px
VIDEO_FRAMES = 4
JSONL_NAME = "data.jsonl"


Scene = tuple[tuple[int, int], tuple[int, int, int], tuple[int, int, int, int]]  # size, background, square box


def _scene(rng: random.Random) -> Scene:
    width, height = size = rng.choice(SIZES)
    side = rng.randint(min(size) // 2, min(size) - 2)
    left, top = rng.randint(0, width - side), rng.randint(0, height - side)
    return size, rng.choice(BACKGROUNDS), (left, top, left + side - 1, top + side - 1)


def _draw_square(path: Path, colour: str, scene: Scene) -> None:
    from PIL import Image, ImageDraw

    size, background, box = scene
    image = Image.new("RGB", size, background)
    ImageDraw.Draw(image).rectangle(box, fill=COLOURS[colour])
    image.save(path, format="PNG")


def _chat(parts: list[dict], question: str, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]
    }


def _one_image(index: int, directory: Path, rng: random.Random) -> dict:
    colour = rng.choice(sorted(COLOURS))
    name = f"images/{index:04d}.png"
    _draw_square(directory / name, colour, _scene(rng))
    return _chat([{"type": "image", "image": name}], "What colour is the square?", f"{colour.capitalize()}.")


def _two_images(index: int, directory: Path, rng: random.Random) -> dict:
    first, second = rng.sample(sorted(COLOURS), 2)
    names = [f"images/{index:04d}_{k}.png" for k in range(2)]
    for name, colour in zip(names, (first, second), strict=True):
        _draw_square(directory / name, colour, _scene(rng))
    parts = [{"type": "image", "image": name} for name in names]
    return _chat(parts, "What colours are the two squares?", f"{first.capitalize()}, then {second}.")


def _video(index: int, directory: Path, rng: random.Random) -> dict:
    before, after = rng.sample(sorted(COLOURS), 2)
    scene = _scene(rng)  # one scene: only the square's colour changes, halfway through
    names = [f"videos/{index:04d}_f{k}.png" for k in range(VIDEO_FRAMES)]
    for k, name in enumerate(names):
        _draw_square(directory / name, before if k < VIDEO_FRAMES // 2 else after, scene)
    return _chat(
        [{"type": "video", "video": names, "fps": 2}], "What colour does the square turn?", f"{after.capitalize()}."
    )


def write_synthetic_vlm_dataset(directory: str | Path, num_samples: int, seed: int = 0) -> Path:
    """Write ``num_samples`` chat samples (PNGs under ``images/`` and ``videos/``, paths relative to the JSONL) to
    ``directory`` and return the JSONL path."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    (directory / "videos").mkdir(exist_ok=True)
    rng = random.Random(f"synthetic_vlm:{seed}")
    records = []
    for index in range(num_samples):
        if index == 1:
            records.append(_video(index, directory, rng))
        elif index % 4 == 2:
            records.append(_two_images(index, directory, rng))
        else:
            records.append(_one_image(index, directory, rng))
    path = directory / JSONL_NAME
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
