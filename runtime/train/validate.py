"""Checks of everything a run reads or writes that do not need the model, run before the model is built: a user
error costs seconds, not a model build or a whole run, and is one line naming the file (exit code 2)."""

from __future__ import annotations

from runtime.checkpoint.export import ExportTargetError, check_export_target
from runtime.train.config import ConfigError, RunConfig


def check_export(config: RunConfig) -> None:
    """``export.dir`` must not name anything the export would delete: the run's own inputs and outputs included."""
    if not config.export.dir:
        return
    protected = {
        "checkpoint.dir": config.checkpoint.dir,
        "log.dir": config.log.dir,
        "data.path": config.data.path,
        "data.tokenizer": config.data.tokenizer,
        "data.processor": config.data.processor,
        "model.path": config.model.path,
    }
    try:
        check_export_target(config.export.dir, overwrite=config.export.overwrite, protected=protected)
    except ExportTargetError as exc:
        raise ConfigError(str(exc)) from None


def check_inputs(config: RunConfig) -> None:
    """Every check that can run before the model is built."""
    check_export(config)
