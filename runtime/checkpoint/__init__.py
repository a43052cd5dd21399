"""Training checkpoints: sharded exact-resume save/load (``dcp``), integrity (``verify``) and export for plain
transformers (``export``)."""

from runtime.checkpoint.dcp import (
    checkpoint_step,
    is_complete_checkpoint,
    latest_checkpoint,
    latest_intact_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from runtime.checkpoint.export import export_hf
from runtime.checkpoint.verify import COMPLETE_MARKER, CheckpointError, verify_checkpoint

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointError",
    "checkpoint_step",
    "export_hf",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "latest_intact_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
