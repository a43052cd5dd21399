"""The keys that shape the learning-rate schedule, recorded in every checkpoint and compared when a run resumes.

A resumed run restores the scheduler's step count and rebuilds the schedule's shape from its own config, so a
changed ``train.steps``, ``optim.lr``, ``optim.lr_scheduler_type``, ``optim.warmup_steps`` or ``optim.min_lr_ratio``
can give the resumed steps another learning rate than the saved run would have used: raising ``train.steps`` from 20
to 30 made the rate jump from 3.2e-4 to 9.3e-4 at step 22 (issue 21). The rule: a resume is refused when a step it
would train gets another learning rate than the saved keys give that step (the schedule the trainer builds,
``runtime/train/optim.py``, evaluated for both), naming the key, both values, the step and what to do (keep the saved
value, or start a new run from the checkpoint's weights). A change that moves no rate passes: more steps of a
constant schedule (``constant``, ``cosine_with_min_lr`` with ``min_lr_ratio: 1``), a warmup that ended before the
checkpoint. A resume that trains no further step (it only exports) and checkpoints written before the schedule was
recorded are not checked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig
    from runtime.train.config import RunConfig

SCHEDULE_KEYS = ("train.steps", "optim.lr", "optim.lr_scheduler_type", "optim.warmup_steps", "optim.min_lr_ratio")


def schedule_record(config: RunConfig | RLConfig) -> dict[str, Any]:
    """The schedule keys' values of a run config (the trainer's or the RL job's), as checkpoints record them."""
    record = {}
    for key in SCHEDULE_KEYS:
        section, name = key.split(".")
        record[key] = getattr(getattr(config, section), name)
    return record


def learning_rates(record: dict[str, Any], first: int, last: int) -> list[float]:
    """The learning rates of training steps ``first``..``last`` (1-based) under the schedule keys ``record``: the
    trainer's own scheduler (``runtime/train/optim.py``), evaluated; the keys are all it reads."""
    import torch

    from runtime.config.common import OptimConfig
    from runtime.train.optim import build_scheduler

    optim = OptimConfig(**{key.split(".")[1]: value for key, value in record.items() if key.startswith("optim.")})
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.lr)
    (factor,) = build_scheduler(probe, optim, record["train.steps"]).lr_lambdas  # LambdaLR: step s trains at index s-1
    return [optim.lr * factor(step - 1) for step in range(first, last + 1)]


def schedule_change(saved: Any, current: dict[str, Any], checkpoint: Any, step: int) -> str | None:
    """A one-line message starting with the first changed key when a step the resumed run trains (``step`` + 1 ..
    ``train.steps``) would get another learning rate under the keys ``current`` than under those ``checkpoint``
    recorded (``saved``), else None."""
    last = current["train.steps"]
    if not isinstance(saved, dict) or last <= step or any(key not in saved for key in SCHEDULE_KEYS):
        return None
    changed = [key for key in SCHEDULE_KEYS if saved[key] != current[key]]
    if not changed:
        return None
    before = learning_rates(saved, step + 1, last)
    after = learning_rates(current, step + 1, last)
    moved = next(
        (k for k, (a, b) in enumerate(zip(before, after, strict=True)) if not math.isclose(a, b, rel_tol=1e-9)), None
    )
    if moved is None:
        return None
    first, at = changed[0], step + 1 + moved
    also = f" (also changed: {', '.join(changed[1:])})" if changed[1:] else ""
    return (
        f"{first}: {current[first]!r} here, {saved[first]!r} in checkpoint {checkpoint}{also}: step {at} would "
        f"train at lr {after[moved]:.3g} where the saved schedule gives {before[moved]:.3g}; a resumed run keeps its "
        f"learning-rate schedule. Set {first}: {saved[first]!r} to resume, or start a new run from its weights: "
        f"resume with train.steps: {step} and export.dir set (it exports without training), then train with "
        f"model.path: <that export> and checkpoint.resume: null"
    )
