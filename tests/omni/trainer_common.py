"""A tiny omni run configuration on the synthetic omni data set (module-level so spawn can pickle it)."""

from __future__ import annotations

from pathlib import Path

from runtime.models.tiny_configs import tiny_config_dict
from tests.omni.omni import MODEL_TYPE


def omni_model_config(aux_loss_coef: float | None = None) -> dict:
    """The spec's tiny thinker as a run config's ``model.config``; the vocab fits the test processor's tokenizer
    (512 tokens, the omni special tokens included). The special-token ids come from the processor."""
    tiny = tiny_config_dict(MODEL_TYPE)
    config = {k: v for k, v in tiny.items() if not k.endswith("_token_id")}
    config["text_config"] = {**config["text_config"], "vocab_size": 576, "output_router_logits": True}
    if aux_loss_coef is not None:
        config["text_config"]["router_aux_loss_coef"] = aux_loss_coef
    return config


def omni_data(root: Path, samples: int = 8) -> tuple[Path, Path]:
    """(data set JSONL, processor directory), written once per ``root``."""
    from runtime.data.audio.processor import build_omni_test_processor
    from runtime.data.audio.synthetic import write_synthetic_omni_dataset

    processor = root / "processor-omni"
    if not (processor / "processor_config.json").exists():
        build_omni_test_processor(processor, MODEL_TYPE)
    data = root / "data-omni" / "data.jsonl"
    if not data.exists():
        data = write_synthetic_omni_dataset(root / "data-omni", samples)
    return data, processor


def omni_run_config(root: Path, aux_loss_coef: float | None = None, **sections) -> dict:
    data, processor = omni_data(root)
    raw = {
        "model": {"type": MODEL_TYPE, "config": omni_model_config(aux_loss_coef), "seed": 0},
        "data": {"path": str(data), "processor": str(processor), "token_budget": 192},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": 3},
        "log": {"dir": str(root / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw
