"""Checks of everything an RL run reads or writes that need no model, run before anything is built: a user error
costs seconds, not a model build, and is one line naming the key (exit code 2). The trainer's checks are reused
where the keys are the same (pipeline directory, transformer config sizes, checkpoint selection, export target)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.checkpoint.export import ExportTargetError, check_export_target
from runtime.parallel.state import ParallelState
from runtime.rl.prompts import Prompt, PromptSampler, read_prompts
from runtime.train.config import ConfigError

__all__ = ["CheckedRLInputs", "check_rl_inputs"]


@dataclass(frozen=True)
class CheckedRLInputs:
    prompts: list[Prompt] = field(default_factory=list)
    resume_from: Path | None = None
    skipped_checkpoints: list[str] = field(default_factory=list)


def check_model(config: Any) -> Any:
    """``model.type`` is a generated DiT whose pipeline directory is ``model.path``; returns its condition class."""
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import dit_model_types, lookup_dit
    from runtime.train.dit import check_pipeline_dir
    from runtime.train.validate import check_dit_transformer_config

    kinds = dit_model_types()
    if config.model.type not in kinds:
        raise ConfigError(
            f"model.type: {config.model.type!r} is not a generated DiT; expected one of {', '.join(kinds)}"
        )
    check_pipeline_dir(config)
    check_dit_transformer_config(config)
    return condition_model_class(lookup_dit(config.model.type).data["condition_model_type"])


def check_sampling(config: Any, condition_class: Any) -> None:
    """Pixel sizes the VAE and the patching divide; frames for video models only."""
    s = config.sampling
    multiple = condition_class.pixel_multiple
    for key in ("height", "width"):
        value = getattr(s, key)
        if value % multiple:
            raise ConfigError(f"sampling.{key}: {value} is not a multiple of {multiple} (the model's pixel multiple)")
    if condition_class.video:
        step = condition_class.temporal_multiple
        if s.frames is None or (s.frames - 1) % step:
            raise ConfigError(
                f"sampling.frames: {config.model.type!r} generates videos of {step} k + 1 frames "
                f"(e.g. {4 * step + 1}), found {s.frames}"
            )
    elif s.frames is not None:
        raise ConfigError(f"sampling.frames: {config.model.type!r} generates images; remove sampling.frames")


def check_outputs(config: Any) -> None:
    """Directories the run creates must not be (or lie below) a file; the export target must replace nothing else."""
    for key, value in (("checkpoint.dir", config.checkpoint.dir), ("log.dir", config.log.dir)):
        if not value:
            continue
        path = Path(value)
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
        if blocker is not None and not blocker.is_dir():
            raise ConfigError(f"{key}: {value}: {blocker} is not a directory (the run creates a directory there)")
    if config.export.dir:
        protected = {
            "checkpoint.dir": config.checkpoint.dir,
            "log.dir": config.log.dir,
            "data.prompts": config.data.prompts,
            "model.path": config.model.path,
        }
        try:
            check_export_target(config.export.dir, overwrite=config.export.overwrite, protected=protected)
        except ExportTargetError as exc:
            raise ConfigError(str(exc)) from None


def check_rl_inputs(config: Any, state: ParallelState) -> CheckedRLInputs:
    """Every check that can run before the model is built. Collective (checkpoint hashing is split over ranks)."""
    from runtime.train.validate import select_checkpoint

    condition_class = check_model(config)
    check_sampling(config, condition_class)
    check_outputs(config)
    try:
        prompts = read_prompts(config.data.prompts)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.prompts: {exc}") from None
    try:
        PromptSampler(len(prompts), config.data.prompts_per_step, config.data.seed, 0, state.dp_size)
    except ValueError as exc:
        raise ConfigError(f"data.prompts_per_step: {exc}") from None
    ranks = config.reward_ranks
    if ranks is not None and max(ranks) >= state.world_size:
        raise ConfigError(f"reward_ranks: {ranks} names a rank the run does not have (world size {state.world_size})")
    resume_from, skipped = select_checkpoint(config, state)
    return CheckedRLInputs(prompts, resume_from, skipped)
