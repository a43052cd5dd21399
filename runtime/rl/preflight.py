"""Preflight: checks of everything an RL run reads or writes that need no model, run before anything is built: a
user error costs seconds, not a model build, and is one line naming the key (exit code 2). The trainer's checks are
reused where the keys are the same (pipeline directory, transformer config sizes, checkpoint selection, export
target)."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.checkpoint.export import ExportTargetError, check_export_target
from runtime.config.errors import ConfigError, ConfigErrors
from runtime.parallel.state import ParallelState
from runtime.rl.pairs import Pair, read_pairs
from runtime.rl.prompts import Prompt, PromptSampler, read_prompts

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig

__all__ = ["CheckedRLInputs", "RefusedOnEveryRank", "check_before_launch", "check_rl_inputs"]


class RefusedOnEveryRank(ConfigError):
    """Refusals agreed on by every rank (a collective): rank 0 says them, the other ranks exit quietly
    (``runtime.rl.__main__``), so a launch prints them once, whatever the ranks' timing."""


@dataclass(frozen=True)
class CheckedRLInputs:
    prompts: list[Prompt] | list[Pair] = field(default_factory=list)  # dpo: its preference pairs
    resume_from: Path | None = None
    skipped_checkpoints: list[str] = field(default_factory=list)


def check_model(config: RLConfig) -> Any:
    """``model.type`` is a generated DiT whose pipeline directory is ``model.path``; returns its condition class."""
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import dit_model_types, lookup_dit
    from runtime.train.dit import check_pipeline_dir
    from runtime.train.preflight import check_dit_transformer_config, supported_problems

    kinds = dit_model_types()
    if config.model.type not in kinds:
        raise ConfigError(
            f"model.type: {config.model.type!r} is not a generated DiT; expected one of {', '.join(kinds)}"
        )
    condition = condition_model_class(lookup_dit(config.model.type).data["condition_model_type"])
    if condition.prediction != "flow":  # the SDE step, its log-prob and the schedules are flow matching's
        raise ConfigError(
            f"model.type: {config.model.type!r} is a {condition.prediction}-prediction diffusion model; "
            f"{config.algorithm} trains flow-matching models ({', '.join(_flow_models(kinds))})"
        )
    check_pipeline_dir(config)
    check_dit_transformer_config(config)
    problems = supported_problems(config.model.type, config.model.path, {}, config.parallel)
    if problems:  # a layout the generated DiT was not patched for
        raise ConfigError(*problems)
    return condition


def _flow_models(kinds: list[str]) -> list[str]:
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import lookup_dit

    types = ((k, lookup_dit(k).data["condition_model_type"]) for k in kinds)
    return [k for k, c in types if condition_model_class(c).prediction == "flow"]


def check_nondiffusers_model(config: RLConfig) -> Any:
    """``model.architecture`` has an adapter with a module class, and ``model.path`` is its checkpoint directory
    (config.json naming it, the weights, vae/); returns the adapter class."""
    from runtime.rl.adapters.nondiffusers import CONFIG_NAME, WEIGHTS_NAME
    from runtime.rl.adapters.registry import get_diffusion_model_cls, registered_diffusion_models

    name, path = config.model.architecture, Path(config.model.path)
    try:
        adapter = get_diffusion_model_cls(name)
    except KeyError:
        known = [a for a in registered_diffusion_models() if getattr(get_diffusion_model_cls(a), "module_class", None)]
        raise ConfigError(f"model.architecture: no adapter for {name!r}; known: {known}") from None
    if getattr(adapter, "module_class", None) is None:
        raise ConfigError(f"model.architecture: {name!r} is a diffusers model; name it by model.type")
    try:
        saved = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: {path}: no readable {CONFIG_NAME} ({exc})") from None
    if not isinstance(saved, dict) or saved.get("_class_name") != name:
        found = saved.get("_class_name") if isinstance(saved, dict) else None
        raise ConfigError(f"model.path: {path} holds a {found!r} checkpoint, not a {name!r} one")
    weights = [f for f in (*getattr(adapter.module_class, "weight_files", ()), WEIGHTS_NAME) if (path / f).is_file()]
    if not weights:
        raise ConfigError(f"model.path: {path}: no weights ({WEIGHTS_NAME} or the model's own format)")
    if not (path / "vae" / "config.json").is_file():
        raise ConfigError(f"model.path: {path}: no vae/ (the VAE that decodes samples for the rewards)")
    return adapter


def check_nondiffusers_sampling(config: RLConfig, adapter: Any) -> None:
    """Pixel sizes the VAE (x8) and the model's latent patches divide, within its latent position table."""
    saved = json.loads((Path(config.model.path) / "config.json").read_text())
    s, patch = config.sampling, int(saved.get("latent_patch_size", 1))
    limit = int(saved.get("max_latent_size", 0)) * patch * 8
    for key in ("height", "width"):
        value = getattr(s, key)
        if value % (8 * patch) or (limit and value > limit):
            raise ConfigError(
                f"sampling.{key}: {value}: expected a multiple of {8 * patch} (VAE x8, latent patch {patch}) up to "
                f"{limit} (max_latent_size)"
            )
    if s.frames is not None:
        raise ConfigError(f"sampling.frames: {config.model.architecture!r} generates images; remove sampling.frames")


def check_sampling(config: RLConfig, condition_class: Any) -> None:
    """Pixel sizes the VAE and the patching divide; frames for video models only. Every problem at once."""
    s = config.sampling
    multiple = condition_class.pixel_multiple
    errors = [
        f"sampling.{key}: {getattr(s, key)} is not a multiple of {multiple} (the model's pixel multiple)"
        for key in ("height", "width")
        if getattr(s, key) % multiple
    ]
    if condition_class.video:
        step = condition_class.temporal_multiple
        if s.frames is None or (s.frames - 1) % step:
            errors.append(
                f"sampling.frames: {config.model.type!r} generates videos of {step} k + 1 frames "
                f"(e.g. {4 * step + 1}), found {s.frames}"
            )
    elif s.frames is not None:
        errors.append(f"sampling.frames: {config.model.type!r} generates images; remove sampling.frames")
    if errors:
        raise ConfigError(*errors)


def check_outputs(config: RLConfig) -> None:
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
            "data.pairs": config.data.pairs,
            "model.path": config.model.path,
        }
        try:
            check_export_target(config.export.dir, overwrite=config.export.overwrite, protected=protected)
        except ExportTargetError as exc:
            raise ConfigError(str(exc)) from None


def check_teacher(config: RLConfig) -> None:
    """A distillation teacher that is the student's own pipeline directory is the student's starting weights, what
    a null teacher is: refused as null is (nothing to learn), whatever the spelling of the path."""
    from runtime.rl.config import algorithm

    teacher = algorithm(config.algorithm).teacher_path(config.algo)
    if teacher is None or not config.model.path:
        return
    if os.path.realpath(teacher) == os.path.realpath(config.model.path):
        key = next((f"{config.algorithm}.{k}" for k, v in vars(config.algo).items() if v == teacher), "teacher")
        raise ConfigError(
            f"{key}: {teacher} is model.path ({config.model.path}): the teacher would be the student's own starting "
            "weights, so distillation learns nothing; name another pipeline directory (a stronger checkpoint of the "
            "same model type)"
        )


def _near_miss(path: Path) -> str:
    """``; did you mean <sibling>?`` for a missing ``path`` whose directory holds a near namesake, else ``""``."""
    try:
        names = os.listdir(path.parent) if path.parent.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f"; did you mean {path.parent / close[0]}?" if close else ""


def read_data(config: RLConfig) -> list[Prompt] | list[Pair]:
    """The prompts (or dpo's preference pairs) the run samples; a missing file is named with a near namesake."""
    pairs = config.data.pairs
    key, value = ("data.prompts", config.data.prompts) if pairs is None else ("data.pairs", pairs)
    path = Path(value)
    if not os.path.lexists(path):
        raise ConfigError(f"{key}: {value}: no such file{_near_miss(path)}")
    try:  # dpo's pairs (runtime/rl/pairs.py) take the prompts' place: the sampler and the checkpoint treat them alike
        if config.data.pairs is None:
            return read_prompts(value)
        return read_pairs(value, config.sampling.frames)  # a video model's pairs: videos of >= frames
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}") from None


def check_static(config: RLConfig) -> list[Prompt] | list[Pair]:
    """Every check that needs neither a process group nor a model, each independent one run (all errors at once);
    returns the data."""
    from runtime.rl.experts import check_experts

    errors, data = ConfigErrors(), []

    def model() -> None:
        if config.model.architecture is not None:
            check_nondiffusers_sampling(config, check_nondiffusers_model(config))
            return
        condition = check_model(config)  # the checks below read the pipeline it found
        errors.run(lambda: check_sampling(config, condition))
        errors.run(lambda: check_experts(config))  # two experts (Wan2.2 A14B): the expert, the algorithm, windows

    errors.run(model)
    errors.run(lambda: check_outputs(config))
    errors.run(lambda: check_teacher(config))
    errors.run(lambda: data.extend(read_data(config)))
    errors.raise_if_any()
    return data


def check_before_launch(config: RLConfig) -> None:
    """What ``check_rl_inputs`` checks without a process group, done once by the launcher before any rank starts
    (as ``runtime.train``'s launcher does): a wrong path, size, expert or output is one line per error in seconds,
    not one per rank after the ranks built their process group. The checkpoint to resume is verified too."""
    from runtime.train.preflight import select_checkpoint

    check_static(config)
    select_checkpoint(config, ParallelState(), warn=False)  # the ranks warn, once


def _agreed(error: ConfigError | None, state: ParallelState) -> list[str] | None:
    """The messages of the first rank that found errors, on every rank (collective), or None."""
    messages = None if error is None else (error.messages or [str(error)])
    if state.world_size == 1:
        return messages
    import torch.distributed as dist

    every: list[list[str] | None] = [None] * state.world_size
    dist.all_gather_object(every, messages)
    return next((m for m in every if m), None)


def check_rl_inputs(config: RLConfig, state: ParallelState) -> CheckedRLInputs:
    """Every check that can run before the model is built. Collective: the ranks agree on the errors (each rank
    raises ``RefusedOnEveryRank`` with the first failing rank's), and checkpoint hashing is split over them."""
    from runtime.train.preflight import select_checkpoint

    prompts: list[Prompt] | list[Pair] = []
    try:
        prompts = check_static(config)
        try:
            PromptSampler(len(prompts), config.data.prompts_per_step, config.data.seed, 0, state.dp_size)
        except ValueError as exc:
            raise ConfigError(f"data.prompts_per_step: {exc}") from None
        ranks = config.reward_ranks
        if ranks is not None and max(ranks) >= state.world_size:
            raise ConfigError(
                f"reward_ranks: {ranks} names a rank the run does not have (world size {state.world_size})"
            )
        error = None
    except ConfigError as exc:
        error = exc
    messages = _agreed(error, state)
    if messages:
        raise RefusedOnEveryRank(*messages)
    resume_from, skipped = select_checkpoint(config, state)
    return CheckedRLInputs(prompts, resume_from, skipped)
