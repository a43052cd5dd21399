"""Training checkpoints: sharded exact-resume save/load (``dcp``) and export for plain transformers (``export``)."""

from runtime.checkpoint.dcp import (
    checkpoint_step,
    is_complete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from runtime.checkpoint.export import export_hf

__all__ = [
    "checkpoint_step",
    "export_hf",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
