"""The VLM-trainer demo: tiny qwen3_vl, Ulysses sp=2 on 2 CPU processes (ViT and LM both split), on a few
generated images (coloured squares, two-image chats and a short video), then the export reloaded by plain
transformers.

Run through `make demo` (runtime/demo.py), or alone: `python -m runtime.demos.train_vlm`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from runtime.demos.train_text import losses, torchrun
from runtime.models.tiny_configs import tiny_vision_config, tiny_vlm_text_config

STEPS, SAMPLES = 24, 48
# the test processor's tokenizer has 512 tokens; M-RoPE sections (2, 3, 3) fill head_dim / 2 = 8
MODEL = {
    "text_config": {**tiny_vlm_text_config("qwen3_vl"), "vocab_size": 512, "max_position_embeddings": 1024},
    "vision_config": tiny_vision_config("qwen3_vl"),
    "tie_word_embeddings": False,
}


def write_config(work: Path, data: Path, processor: Path) -> Path:
    raw = {
        "model": {"type": "qwen3_vl", "config": MODEL, "seed": 0},
        "data": {"path": str(data), "processor": str(processor), "token_budget": 256},
        "parallel": {"sp": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 3, "min_lr_ratio": 0.1},
        "train": {"steps": STEPS},
        "log": {"dir": str(work / "log"), "progress": False, "interval": 6},
        "export": {"dir": str(work / "hf")},
    }
    path = work / "vlm.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def main() -> bool:
    import transformers

    from runtime.data.vision.processor import build_test_processor
    from runtime.data.vision.synthetic import write_synthetic_vlm_dataset
    from runtime.train.model import load_pretrained

    work = Path(tempfile.mkdtemp(prefix="patchgen-vlm-demo-"))
    try:
        data = write_synthetic_vlm_dataset(work / "data", SAMPLES, seed=0)
        images = sum(1 for _ in (work / "data").rglob("*.png"))
        processor = build_test_processor(work / "processor", "qwen3_vl")
        print(
            f"-- {SAMPLES} chats over {images} generated PNGs (one video); {STEPS} steps, torchrun 2 processes, sp=2",
            flush=True,
        )
        torchrun(write_config(work, data, processor))
        curve = losses(work / "log")
        falling = curve[STEPS] < curve[1] - 0.5
        # missing/unexpected/mismatched weights are an error (one line naming them), never a warning
        plain = load_pretrained(transformers.AutoModelForImageTextToText, str(work / "hf"))
        loaded = type(plain).__name__ == "Qwen3VLForConditionalGeneration"
        print(
            f"qwen3_vl loss step 1 -> {STEPS}: {curve[1]:.4f} -> {curve[STEPS]:.4f} "
            f"({'falling' if falling else 'NOT falling'})"
        )
        print(f"plain transformers loads the export ({type(plain).__name__}): {loaded}")
        return falling and loaded
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
