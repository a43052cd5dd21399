"""A small synthetic omni chat data set (audio, images, a video with its audio track), for demos and trainer tests.

Audio clips are pure tones (a named pitch) or noise bursts, 0.4-2.5 s at 16 kHz, written as wav (16-bit PCM) or flac
at 16, 22.05 or 8 kHz, so decoding, down- and up-sampling all run; clip lengths are rarely whole 100-frame windows.
Images are the coloured squares of ``synthetic_vlm``. Samples cycle through: an audio question, an image question,
an audio + image question, and (sample 3) a 4-frame video with a tone track (``use_audio_in_video`` layout). Drawn
from ``random.Random(seed)`` / a seeded numpy generator, so a seed gives the same files byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from runtime.data.audio.waveforms import write_audio
from runtime.data.vision.synthetic import COLOURS, VIDEO_FRAMES, _draw_square, _scene

JSONL_NAME = "data.jsonl"
TONES = {"low": 220.0, "middle": 440.0, "high": 880.0}
RATES = (16000, 22050, 8000)


def _clip(rng: random.Random, noise: np.random.Generator, kind: str, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    if kind == "noise":
        return (0.3 * noise.standard_normal(t.size)).astype(np.float32)
    return (0.5 * np.sin(2 * np.pi * TONES[kind] * t + rng.random())).astype(np.float32)


def _audio(index: int, tag: str, directory: Path, rng: random.Random, noise: np.random.Generator) -> tuple[str, str]:
    kind = rng.choice([*sorted(TONES), "noise"])
    rate = RATES[index % len(RATES)]
    name = f"audio/{index:04d}_{tag}.{'flac' if index % 2 else 'wav'}"
    write_audio(directory / name, _clip(rng, noise, kind, rng.uniform(0.4, 2.5), rate), rate)
    return name, kind


def _answer(kind: str) -> str:
    return "Noise." if kind == "noise" else f"A {kind} tone."


def _chat(parts: list[dict], question: str, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]
    }


def _sample(index: int, directory: Path, rng: random.Random, noise: np.random.Generator) -> dict:
    if index == 3:
        before, after = rng.sample(sorted(COLOURS), 2)
        scene = _scene(rng)
        frames = [f"videos/{index:04d}_f{k}.png" for k in range(VIDEO_FRAMES)]
        for k, name in enumerate(frames):
            _draw_square(directory / name, before if k < VIDEO_FRAMES // 2 else after, scene)
        track, kind = _audio(index, "track", directory, rng, noise)
        video = {"type": "video", "video": frames, "fps": 2, "audio": track}
        return _chat(
            [video],
            "What colour does the square turn, and what do you hear?",
            f"{after.capitalize()}; {_answer(kind).lower()}",
        )
    if index % 3 == 0:
        name, kind = _audio(index, "clip", directory, rng, noise)
        return _chat([{"type": "audio", "audio": name}], "What do you hear?", _answer(kind))
    colour = rng.choice(sorted(COLOURS))
    image = f"images/{index:04d}.png"
    _draw_square(directory / image, colour, _scene(rng))
    if index % 3 == 1:
        return _chat([{"type": "image", "image": image}], "What colour is the square?", f"{colour.capitalize()}.")
    name, kind = _audio(index, "clip", directory, rng, noise)
    parts = [{"type": "image", "image": image}, {"type": "audio", "audio": name}]
    return _chat(parts, "Colour and sound?", f"{colour.capitalize()}; {_answer(kind).lower()}")


def write_synthetic_omni_dataset(directory: str | Path, num_samples: int, seed: int = 0) -> Path:
    """Write ``num_samples`` chats (media under ``audio/``, ``images/``, ``videos/``) and return the JSONL path."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    directory = Path(directory)
    for sub in ("audio", "images", "videos"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"synthetic_omni:{seed}")
    noise = np.random.default_rng(seed)
    records = [_sample(index, directory, rng, noise) for index in range(num_samples)]
    path = directory / JSONL_NAME
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
