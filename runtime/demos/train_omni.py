"""The omni demo: the tiny qwen3_omni_moe thinker (audio encoder + ViT + MoE LM), Ulysses sp=2 on 2 CPU processes
(audio encoder, ViT and LM all split), on generated audio (tones and noise as wav/flac at 8, 16 and 22.05 kHz),
images and a short video with its audio track; then the export reloaded by plain transformers, whose logits on a
sample with audio and an image equal the generated model's.

Run through `make demo` (runtime/demo.py), or alone: `python -m runtime.demos.train_omni`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from runtime.demos.train_text import losses, torchrun
from runtime.models.tiny_configs import tiny_config_dict

MODEL_TYPE = "qwen3_omni_moe_thinker"
STEPS, SAMPLES = 6, 10


def model_config() -> dict:
    """The spec's tiny thinker; the vocab fits the test processor's tokenizer, the token ids come from it."""
    tiny = tiny_config_dict(MODEL_TYPE)
    config = {k: v for k, v in tiny.items() if not k.endswith("_token_id")}
    config["text_config"] = {**config["text_config"], "vocab_size": 512}
    return config


def write_config(work: Path, data: Path, processor: Path) -> Path:
    raw = {
        "model": {"type": MODEL_TYPE, "config": model_config(), "seed": 0},
        "data": {"path": str(data), "processor": str(processor), "token_budget": 192},
        "parallel": {"sp": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "min_lr_ratio": 0.1},
        "train": {"steps": STEPS},
        "log": {"dir": str(work / "log"), "progress": False, "interval": 4},
        "export": {"dir": str(work / "hf")},
    }
    path = work / "omni.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def same_logits(export: Path, processor_dir: Path, data: Path) -> bool:
    """Plain transformers and the generated class give identical logits from the export (eager experts)."""
    import torch
    import transformers

    from runtime.data.audio.packing import pack_omni_row
    from runtime.data.audio.processor import load_omni_processor
    from runtime.data.audio.tokenization import tokenize_omni
    from runtime.data.samples import read_jsonl
    from runtime.models.registry import lookup
    from runtime.train.model import load_pretrained

    # strict: weights that do not match the model are an error naming them, never a warning
    plain = load_pretrained(transformers.AutoModelForImageTextToText, str(export), experts_implementation="eager")
    ours = load_pretrained(lookup(MODEL_TYPE).model_class(), str(export), experts_implementation="eager")
    processor = load_omni_processor(processor_dir)
    fn = type(ours).get_position_id_func(ours.config)
    row = pack_omni_row([tokenize_omni(s, processor, fn, ours.config) for s in read_jsonl(data)[2:4]], 512)
    with torch.no_grad():
        equal = torch.equal(plain(**row).logits, ours(**row).logits)
    print(f"plain transformers loads the export ({type(plain).__name__}); identical logits: {equal}")
    return equal and type(plain).__module__.startswith("transformers.")


def main() -> bool:
    from runtime.data.audio.processor import build_omni_test_processor
    from runtime.data.audio.synthetic import write_synthetic_omni_dataset

    work = Path(tempfile.mkdtemp(prefix="patchgen-omni-demo-"))
    try:
        data = write_synthetic_omni_dataset(work / "data", SAMPLES, seed=0)
        clips = sum(1 for p in (work / "data" / "audio").iterdir())
        processor = build_omni_test_processor(work / "processor", MODEL_TYPE)
        print(
            f"-- {SAMPLES} chats, {clips} generated clips (tones, noise); {STEPS} steps, torchrun 2, sp=2", flush=True
        )
        torchrun(write_config(work, data, processor))
        curve = losses(work / "log")
        falling = curve[STEPS] < curve[1] - 0.3
        print(
            f"qwen3_omni_moe thinker loss step 1 -> {STEPS}: {curve[1]:.4f} -> {curve[STEPS]:.4f} "
            f"({'falling' if falling else 'NOT falling'})"
        )
        return same_logits(work / "hf", processor, data) and falling
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
