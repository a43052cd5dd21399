"""A tiny VLM run configuration on the synthetic image-chat data set (module-level so spawn can pickle it)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.models.tiny_configs import tiny_vision_config, tiny_vlm_text_config


def vlm_model_config(model_type: str) -> dict:
    """The tiny VLM of the model's spec as a run config's ``model.config``; the vocab fits the test processor's
    tokenizer (512 tokens, chat and vision special tokens included)."""
    text = {**tiny_vlm_text_config(model_type), "vocab_size": 576, "max_position_embeddings": 512}
    # Keys qwen3_vl_moe's text config does not have (model.config keys are checked): its router always normalises,
    # and its forward takes output_router_logits as an argument, not from the config.
    for dead in ("norm_topk_prob", "output_router_logits"):
        text.pop(dead, None)
    return {"text_config": text, "vision_config": tiny_vision_config(model_type), "tie_word_embeddings": False}


def processor_dir(root: Path, model_type: str = "qwen3_vl") -> Path:
    from runtime.data.vision.processor import build_test_processor

    target = root / f"processor-{model_type}"
    if not (target / "processor_config.json").exists():
        build_test_processor(target, model_type)
    return target


def dataset(root: Path, text_only: int = 0) -> Path:
    """The synthetic image chats, plus ``text_only`` chats without any image (ranks that get one run the dummy)."""
    from runtime.data.vision.synthetic import write_synthetic_vlm_dataset

    path = write_synthetic_vlm_dataset(root / "data", 12)
    if text_only:
        chats = [
            {
                "messages": [
                    {"role": "user", "content": f"Count to {n}."},
                    {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))},
                ]
            }
            for n in range(3, 3 + text_only)
        ]
        with path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(c) + "\n" for c in chats)
    return path


def vlm_run_config(root: Path, model_type: str = "qwen3_vl", text_only: int = 0, **sections) -> dict:
    raw = {
        "model": {"type": model_type, "config": vlm_model_config(model_type), "seed": 0},
        "data": {
            "path": str(dataset(root, text_only)),
            "processor": str(processor_dir(root, model_type)),
            "token_budget": 96,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": 3},
        "log": {"dir": str(root / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw
