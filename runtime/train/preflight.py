"""Preflight: checks of everything a run reads or writes that do not need the model, run before the model is
built: a user error costs seconds, not a model build or a whole run, and is one line naming the file (exit code 2)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runtime.checkpoint.dcp import latest_intact_checkpoint
from runtime.checkpoint.export import ExportTargetError, check_export_target
from runtime.checkpoint.rank_state import rank_files, saved_extra
from runtime.checkpoint.verify import CheckpointError, read_marker, verify_checkpoint
from runtime.config.common import ParallelConfig
from runtime.config.errors import ConfigError
from runtime.data.samples import AudioPart, ChatSample, ImagePart, LocatedSample, VideoPart, read_samples_located
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig
from runtime.train.model_limits import random_init_problem, size_problem
from runtime.train.schedule_keys import followed_schedule, schedule_record

# Images (and video frames) of this many first samples are opened and verified up front, and their audio files'
# headers checked (runtime.data.audio.waveforms.check_audio); every referenced file is checked to exist. The others are
# decoded when the data is tokenized, where a failure is the same one-line error.
VERIFIED_IMAGE_LINES = 8


@dataclass(frozen=True)
class CheckedInputs:
    """What the checks found and the run goes on with."""

    samples: list[LocatedSample] = field(default_factory=list)  # the parsed data set, each sample with file:line
    resume_from: Path | None = None  # a verified checkpoint, or None for a fresh start
    skipped_checkpoints: list[str] = field(default_factory=list)  # damaged ones `resume: auto` passed over
    dit_samples: list = field(default_factory=list)  # DiTs: the parsed data file (runtime.data.dit.manifest)


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
        "data.cache": config.data.cache,
        "data.media_dir": config.data.media_dir,
    }
    try:
        check_export_target(config.export.dir, overwrite=config.export.overwrite, protected=protected)
    except ExportTargetError as exc:
        raise ConfigError(str(exc)) from None


def check_output_dirs(config: RunConfig) -> None:
    """The directories a run creates and writes (checkpoints, logs, the DiT condition cache) must not be, or lie
    below, a file: found now, not as a traceback when the first write comes."""
    for key, value in (
        ("checkpoint.dir", config.checkpoint.dir),
        ("log.dir", config.log.dir),
        ("data.cache", config.data.cache),
    ):
        if not value:
            continue
        path = Path(value)
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
        if blocker is not None and not blocker.is_dir():
            raise ConfigError(
                f"{key}: {value}: {blocker} is not a directory (the run creates a directory there); name another "
                f"place or move the file"
            )


def _media_files(sample: object) -> tuple[list[Path], list[Path]]:
    """A chat sample's image files (images and video frames) and audio files (clips and video tracks)."""
    images: list[Path] = []
    audio: list[Path] = []
    if not isinstance(sample, ChatSample):
        return images, audio
    for message in sample.messages:
        for part in () if isinstance(message.content, str) else message.content:
            if isinstance(part, ImagePart):
                images.append(part.path)
            elif isinstance(part, VideoPart):
                images.extend(part.frames)
                audio.extend([part.audio] if part.audio is not None else [])
            elif isinstance(part, AudioPart):
                audio.append(part.path)
    return images, audio


def check_media_dir(config: RunConfig) -> None:
    media_dir = config.data.media_dir
    if media_dir is not None and not Path(media_dir).is_dir():
        what = "not a directory" if Path(media_dir).exists() else "not a directory (it does not exist)"
        raise ConfigError(f"data.media_dir: {media_dir}: {what}")


def verify_image(path: Path, where: str) -> None:
    """Open ``path`` and check its structure without decoding the pixels (PIL ``verify``)."""
    from runtime.data.images import ImageTooLarge, open_image

    try:
        with open_image(path) as image:
            image.verify()
    except ImageTooLarge as exc:
        raise ConfigError(f"data.path: {where}: cannot read image {exc}") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, struct.error, ... for broken files
        raise ConfigError(f"data.path: {where}: cannot read image {path}: {exc}") from None


def check_data(config: RunConfig) -> list[LocatedSample]:
    """Parse the whole data file (cheap: text; every referenced media file must exist, inside the media root) and
    verify the images and audio headers of its first ``VERIFIED_IMAGE_LINES`` samples; one-line errors naming
    file:line."""
    from runtime.data.audio.waveforms import check_audio

    path = Path(config.data.path)
    if not path.exists():
        raise ConfigError(f"data.path: {path}: file not found")
    if not path.is_file():
        raise ConfigError(f"data.path: {path}: not a file (expected a .jsonl file or a plain-text file)")
    check_media_dir(config)
    try:
        samples = read_samples_located(path, media_dir=config.data.media_dir)
    except ValueError as exc:  # names file:line and what was expected
        raise ConfigError(f"data.path: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"data.path: {path}: cannot read it: {exc.strerror or exc}") from None
    if not samples:
        raise ConfigError(f"data.path: {path}: no samples (the file is empty or holds only blank lines)")
    for located in samples[:VERIFIED_IMAGE_LINES]:
        images, audio = _media_files(located.sample)
        for image in images:
            verify_image(image, located.where)
        for clip in audio:
            try:
                check_audio(clip)
            except ValueError as exc:
                raise ConfigError(f"data.path: {located.where}: {exc}") from None
    return samples


def select_checkpoint(config: RunConfig, state: ParallelState, warn: bool = True) -> tuple[Path | None, list[str]]:
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
    if warn and state.rank == 0:
        for message in skipped:
            print(f"warning: skipping a damaged checkpoint: {message}", file=sys.stderr, flush=True)
    return found, skipped


def check_model_path(config: RunConfig) -> None:
    path = config.model.path
    if path is not None and not (Path(path) / "config.json").is_file():
        what = "no config.json in it" if Path(path).is_dir() else "not a directory"
        raise ConfigError(f"model.path: {path}: {what} (expected a local HF checkpoint: config.json + *.safetensors)")


def check_random_init(config: RunConfig) -> None:
    """A random init (no ``model.path``) must be buildable on this machine (``runtime/train/model_limits.py``)."""
    from runtime.models.registry import REGISTRY

    entry = REGISTRY.get(config.model.type)
    if config.model.path is not None or entry is None:
        return
    problem = random_init_problem(config.model.type, config.model.config, entry.model_class())
    if problem:
        raise ConfigError(problem)


def check_dit_transformer_config(config: RunConfig) -> None:
    """The sizes in a DiT pipeline's ``transformer/config.json`` within ``model_limits``' bounds (a layer count of a
    billion never finishes building), and its transformer's weight files whole (a truncated copy, found from the
    headers in milliseconds, not when every rank loads it). Shared by the trainer and the RL job."""
    from runtime.diffusion.weight_headers import damaged_transformer_weights

    path = Path(config.model.path) / "transformer" / "config.json"
    try:
        values = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(
            f"model.path: {path}: not a readable JSON config ({' '.join(str(exc).split())[:200]})"
        ) from None
    found = size_problem(values) if isinstance(values, dict) else ("", "expected a JSON object")
    if found:
        raise ConfigError(f"model.path: {path}: {found[0]}: {found[1]}")
    damaged = damaged_transformer_weights(path.parent.parent)
    if damaged:
        raise ConfigError(f"model.path: {damaged}")


def _model_config_values(model_type: str, path: str | None, overrides: dict, dit: bool) -> tuple[dict, str]:
    """The model's config as plain values, and the key an error about them names: a DiT's transformer config, a
    checkpoint's config.json, or a random init's config (its type's defaults under ``model.config``)."""
    if dit or path is not None:
        source = Path(path) / ("transformer" if dit else "") / "config.json"
        try:
            values = json.loads(source.read_bytes())
        except (OSError, ValueError, RecursionError):
            return {}, str(source)  # unreadable: the path checks say so
        return (values if isinstance(values, dict) else {}), f"model.path: {source}"
    import transformers

    try:
        built = transformers.AutoConfig.for_model(model_type, **overrides)
    except (TypeError, ValueError):
        return {}, "model.config"  # check_random_init says why
    return built.to_dict(), "model.config"


def supported_problems(model_type: str, path: str | None, overrides: dict, parallel: ParallelConfig) -> list[str]:
    """The parallel layout and the model's config options against what the generated class declares it supports
    (``runtime/models/supports.py``): one line per layout or option its patched code would silently get wrong.
    Shared by the trainer and the RL job (a DiT's ``path`` is its pipeline directory)."""
    from runtime.models.registry import REGISTRY
    from runtime.models.supports import layout_problems, option_problems

    entry = REGISTRY.get(model_type)
    if entry is None:
        return []
    ring = parallel.ring or 1
    values, where = _model_config_values(model_type, path, overrides, entry.family == "dit")
    return layout_problems(entry, parallel.sp, ring, parallel.ep) + option_problems(entry, values, ring, where)


def check_supported(config: RunConfig) -> None:
    """``supported_problems`` of a run config, all at once."""
    problems = supported_problems(config.model.type, config.model.path, config.model.config, config.parallel)
    if problems:
        raise ConfigError(*problems)


def check_resume_schedule(config: RunConfig, checkpoint: Path) -> None:
    """The resumed steps train at the learning rates the checkpoint's run planned, or ``checkpoint.schedule_change``
    says what else (``runtime/train/schedule_keys.py``): read from its recorded schedule before the model is built."""
    try:
        extra = saved_extra(checkpoint, read_marker(checkpoint)["world_size"])
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.resume: {exc}") from None
    step = extra.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        current = schedule_record(config)
        source = rank_files(checkpoint, 0)[1]  # the file saved_extra read
        followed_schedule(extra.get("schedule"), current, checkpoint, step, config.checkpoint.schedule_change, source)


def check_before_launch(config: RunConfig, exports: bool = True) -> None:
    """What ``check_inputs`` checks without a process group, done once by the launcher before any rank starts (a
    mistake in a path, the export directory, the checkpoint to resume or its schedule is one line in seconds, not
    one per rank after the ranks started): the model and pipeline paths, the output and export directories, the
    media directory, the checkpoint to resume (verified) and its recorded schedule. The data is read by the ranks."""
    if _is_dit(config):
        from runtime.train.dit import check_pipeline_dir

        check_pipeline_dir(config)
        check_dit_transformer_config(config)
        check_media_dir(config)
    else:
        check_model_path(config)
        check_random_init(config)
    check_supported(config)
    check_output_dirs(config)
    if exports:
        check_export(config)
    resume_from, _ = select_checkpoint(config, ParallelState(), warn=False)  # the ranks warn, once
    if resume_from is not None:
        check_resume_schedule(config, resume_from)


def check_inputs(config: RunConfig, state: ParallelState, exports: bool = True) -> CheckedInputs:
    """Every check that can run before the model is built. Collective (checkpoint hashing is split over ranks).
    ``exports``: whether the job writes ``export.dir`` (``runtime.train.prepare`` never does: not checked there)."""
    if _is_dit(config):
        from runtime.train.dit import check_pipeline_dir
        from runtime.train.dit_data import read_dit_samples

        check_pipeline_dir(config)  # a diffusers pipeline directory, not an HF checkpoint
        check_dit_transformer_config(config)
        check_supported(config)
        check_output_dirs(config)
        if exports:
            check_export(config)
        check_media_dir(config)
        dit_samples = read_dit_samples(config)  # {"caption", "image"|"video"} lines, every media file present
        resume_from, skipped = select_checkpoint(config, state)
        if resume_from is not None:
            check_resume_schedule(config, resume_from)
        return CheckedInputs(resume_from=resume_from, skipped_checkpoints=skipped, dit_samples=dit_samples)
    check_model_path(config)
    check_output_dirs(config)
    if exports:
        check_export(config)
    samples = check_data(config)
    check_random_init(config)
    check_supported(config)
    resume_from, skipped = select_checkpoint(config, state)
    if resume_from is not None:
        check_resume_schedule(config, resume_from)
    return CheckedInputs(samples=samples, resume_from=resume_from, skipped_checkpoints=skipped)


def _is_dit(config: RunConfig) -> bool:
    from runtime.models.registry import REGISTRY

    entry = REGISTRY.get(config.model.type)
    return entry is not None and entry.family == "dit"
