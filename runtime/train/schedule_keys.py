"""The keys that shape the learning-rate schedule, recorded in every checkpoint and compared when a run resumes.

A resumed run restores the scheduler's step count and rebuilds the schedule's shape from its own config, so a
changed ``train.steps``, ``optim.lr``, ``optim.lr_scheduler_type``, ``optim.warmup_steps`` or ``optim.min_lr_ratio``
gives the resumed steps another learning rate than the saved run would have used: raising ``train.steps`` from 20 to
30 made the rate jump from 3.2e-4 to 9.3e-4 at step 22 (issue 21). The rule: such a resume is refused, naming the key,
both values and what to do (keep the saved value, or start a new run from the checkpoint's weights). A resume that
trains no further step (``train.steps`` at most the checkpoint's step: it only exports) and checkpoints written
before the schedule was recorded are not checked.
"""

from __future__ import annotations

from typing import Any

SCHEDULE_KEYS = ("train.steps", "optim.lr", "optim.lr_scheduler_type", "optim.warmup_steps", "optim.min_lr_ratio")


def schedule_record(config: Any) -> dict[str, Any]:
    """The schedule keys' values of a run config (the trainer's or the RL job's), as checkpoints record them."""
    record = {}
    for key in SCHEDULE_KEYS:
        section, name = key.split(".")
        record[key] = getattr(getattr(config, section), name)
    return record


def schedule_change(saved: Any, current: dict[str, Any], checkpoint: Any, step: int) -> str | None:
    """A one-line message starting with the first changed key when the resumed run would train at least one step
    (``train.steps`` above the checkpoint's ``step``) under another schedule than ``checkpoint`` recorded
    (``saved``), else None. A run that trains no further step only exports: that is how the weights of a
    checkpoint are taken into a new run under a new schedule."""
    if not isinstance(saved, dict) or current["train.steps"] <= step:
        return None
    changed = [key for key in SCHEDULE_KEYS if key in saved and saved[key] != current[key]]
    if not changed:
        return None
    first = changed[0]
    also = f" (also changed: {', '.join(changed[1:])})" if changed[1:] else ""
    return (
        f"{first}: {current[first]!r} here, {saved[first]!r} in checkpoint {checkpoint}{also}; a resumed run keeps "
        f"the learning-rate schedule it was saved with. Set {first}: {saved[first]!r} to resume, or start a new run "
        f"from its weights: resume with train.steps: {step} and export.dir set (it exports without training), then "
        f"train with model.path: <that export> and checkpoint.resume: null"
    )
