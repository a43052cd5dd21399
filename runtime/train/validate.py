"""Checks of everything a run reads or writes that do not need the model, run before the model is built: a user
error costs seconds, not a model build or a whole run, and is one line naming the file (exit code 2)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from runtime.checkpoint.dcp import latest_intact_checkpoint
from runtime.checkpoint.export import ExportTargetError, check_export_target
from runtime.checkpoint.verify import CheckpointError, verify_checkpoint
from runtime.parallel.state import ParallelState
from runtime.train.config import ConfigError, RunConfig


@dataclass(frozen=True)
class CheckedInputs:
    """What the checks found and the run goes on with."""

    resume_from: Path | None = None  # a verified checkpoint, or None for a fresh start
    skipped_checkpoints: list[str] = field(default_factory=list)  # damaged ones `resume: auto` passed over


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


def select_checkpoint(config: RunConfig, state: ParallelState) -> tuple[Path | None, list[str]]:
    """The verified checkpoint to resume from and the damaged ones skipped (collective when distributed).

    ``resume: auto`` takes the newest intact checkpoint in ``checkpoint.dir``, warning about each damaged newer one;
    if there are checkpoints but none is intact that is an error (starting over would silently discard them).
    An explicit ``resume: <path>`` that does not verify is an error.
    """
    ckpt = config.checkpoint
    if ckpt.resume is None or (ckpt.resume == "auto" and not ckpt.dir):
        return None, []
    if ckpt.resume != "auto":
        try:
            verify_checkpoint(Path(ckpt.resume))
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint.resume: {exc}") from None
        return Path(ckpt.resume), []
    found, damaged = latest_intact_checkpoint(Path(ckpt.dir))
    skipped = [str(exc) for exc in damaged]
    if found is None and skipped:
        raise ConfigError(
            f"checkpoint.resume: auto: no intact checkpoint in {ckpt.dir}; the newest says: {skipped[0]}; set "
            f"checkpoint.resume: null to start over or resume from a copy you trust"
        )
    if state.rank == 0:
        for message in skipped:
            print(f"warning: skipping a damaged checkpoint: {message}", file=sys.stderr, flush=True)
    return found, skipped


def check_inputs(config: RunConfig, state: ParallelState) -> CheckedInputs:
    """Every check that can run before the model is built. Collective (checkpoint hashing is split over ranks)."""
    check_export(config)
    resume_from, skipped = select_checkpoint(config, state)
    return CheckedInputs(resume_from=resume_from, skipped_checkpoints=skipped)
