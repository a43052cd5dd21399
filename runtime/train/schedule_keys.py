"""The keys that shape the learning-rate schedule, recorded in every checkpoint and compared when a run resumes.

A resumed run restores the scheduler's step count and the optimizer's state. When its config changes a schedule key
(``train.steps``, ``optim.lr``, ``optim.lr_scheduler_type``, ``optim.warmup_steps``, ``optim.min_lr_ratio``) so that
a step it would train gets another learning rate than the saved run planned for it (both schedules evaluated with
the trainer's own scheduler, ``runtime/train/optim.py``; past a schedule's last step its last rate holds),
``checkpoint.schedule_change`` says what happens:

* ``refuse`` (default): one line naming the key, both values, the first step whose rate would move and the choices;
* ``continue``: the resumed steps follow the saved run's curve; steps past its end train at its last rate (extending
  a finished cosine run trains on at the minimum). The checkpoints go on recording the saved keys;
* ``replan``: the resumed steps follow this config's schedule, evaluated at their step numbers: what HF Trainer and
  torchtitan do when a run resumes with another ``max_steps`` (the rate may jump at the first resumed step).

Either way the AdamW state, the data position and the step count are the saved ones, and the log says the first resumed
step's rate under both schedules. The saved keys pass the config's own checks first (``saved_schedule_problems``): an
edited checkpoint is a user error naming its per-rank file and the key. A change that moves no rate needs no choice:
more steps of a constant schedule (``constant``, ``cosine_with_min_lr`` with ``min_lr_ratio: 1``), a warmup that ended
before the checkpoint. A resume that trains no further step (it only exports) and checkpoints written before the
schedule was recorded are not checked.
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
    end = record["train.steps"] - 1  # past the schedule's last step its last rate holds
    return [optim.lr * factor(min(step - 1, end)) for step in range(first, last + 1)]


def saved_schedule_problems(saved: dict[str, Any]) -> list[str]:
    """The run config's own checks (types, 64-bit finite numbers, ranges, choices: ``TRAIN_RULES``) on the schedule
    keys a checkpoint recorded, one line each: ``checkpoint.schedule_change: continue`` trains on them, and an edited
    checkpoint (its hashes recomputed) verifies, so they are user input like the config's."""
    from runtime.config.common import OptimConfig
    from runtime.config.errors import ConfigErrors
    from runtime.config.sections import collect_section
    from runtime.train.config import TRAIN_RULES, TrainConfig

    errors = ConfigErrors()
    optim = {key.split(".")[1]: saved[key] for key in SCHEDULE_KEYS if key.startswith("optim.")}
    collect_section(OptimConfig, optim, "optim", TRAIN_RULES, errors)
    collect_section(TrainConfig, {"steps": saved["train.steps"]}, "train", TRAIN_RULES, errors)
    return errors.messages


def schedule_change(saved: Any, current: dict[str, Any], checkpoint: Any, step: int, source: Any = None) -> str | None:
    """A one-line message starting with the first changed key when a step the resumed run trains (``step`` + 1 ..
    ``train.steps``) would get another learning rate under the keys ``current`` than under those ``checkpoint``
    recorded (``saved``, read from its file ``source``), else None; a ``ConfigError`` naming that file and the key
    when the recorded keys would not pass the config's checks."""
    from runtime.config.errors import ConfigError

    last = current["train.steps"]
    if not isinstance(saved, dict) or last <= step or any(key not in saved for key in SCHEDULE_KEYS):
        return None
    problems = saved_schedule_problems(saved)
    if problems:
        raise ConfigError(
            f"checkpoint.resume: {source or checkpoint}: the learning-rate schedule it recorded does not pass the "
            f"config's checks (an edited checkpoint?): {'; '.join(f'extra.schedule.{p}' for p in problems)}; "
            f"resume from another checkpoint"
        )
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
        f"train at lr {after[moved]:.3g} where the saved schedule gives {before[moved]:.3g}. Set "
        f"checkpoint.schedule_change: continue (the saved curve, its last rate past its end) or replan (this "
        f"config's schedule from step {step + 1}), or {first}: {saved[first]!r}"
    )


def followed_schedule(
    saved: Any, current: dict[str, Any], checkpoint: Any, step: int, mode: str, source: Any = None
) -> tuple[dict[str, Any], str | None]:
    """(the schedule keys the resumed run follows, a line for the log when they are not this config's plain plan);
    a ``ConfigError`` when the rates would move and ``mode`` (``checkpoint.schedule_change``) is ``refuse``, or when
    the keys ``checkpoint`` recorded (in its file ``source``) would not pass the config's checks."""
    from runtime.config.errors import ConfigError

    change = schedule_change(saved, current, checkpoint, step, source)
    if change is None:
        return current, None
    if mode == "refuse":
        raise ConfigError(change)
    followed = saved if mode == "continue" else current
    other = current if mode == "continue" else saved
    ours, theirs = learning_rates(followed, step + 1, step + 1)[0], learning_rates(other, step + 1, step + 1)[0]
    changed = ", ".join(f"{k} {saved[k]!r} -> {current[k]!r}" for k in SCHEDULE_KEYS if saved[k] != current[k])
    what = "the saved curve (its last rate past its end)" if mode == "continue" else "this config's schedule"
    return followed, (
        f"schedule changed ({changed}); checkpoint.schedule_change: {mode}: the resumed steps follow {what}: step "
        f"{step + 1} trains at lr {ours:.3g} (the {'new' if mode == 'continue' else 'saved'} schedule: {theirs:.3g})"
    )


def follow_schedule(scheduler: Any, optimizer: Any, record: dict[str, Any], total_steps: int) -> None:
    """Make the resumed ``scheduler`` (its step count loaded) follow the schedule keys ``record`` over a run of
    ``total_steps``, and set the rate of the next step from it (the checkpoint stored the one its own schedule gave).
    A ``record`` that is this run's plan changes nothing: the same factor of the same step, bitwise."""
    import torch

    from runtime.config.common import OptimConfig
    from runtime.train.optim import build_scheduler

    optim = OptimConfig(**{key.split(".")[1]: value for key, value in record.items() if key.startswith("optim.")})
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.lr)
    plan = build_scheduler(probe, optim, record["train.steps"]).lr_lambdas
    if total_steps > record["train.steps"]:  # an extended run that continues the saved curve: its last rate holds
        plan = [_holding(factor, record["train.steps"] - 1) for factor in plan]
    scheduler.lr_lambdas = list(plan) * (len(scheduler.base_lrs) // len(plan))
    scheduler.base_lrs = [optim.lr] * len(scheduler.base_lrs)
    for group in optimizer.param_groups:
        group["initial_lr"] = optim.lr
    pairs = zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    rates = [base * factor(scheduler.last_epoch) for factor, base in pairs]  # LambdaLR.get_lr's own expression
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def _holding(factor: Any, end: int) -> Any:
    """``factor`` that holds its value at index ``end`` past it, of the same kind (a plain function or a
    ``functools.partial``: LambdaLR's state_dict records them differently, and a resume compares that structure)."""
    import functools
    import types

    if isinstance(factor, types.FunctionType):

        def held(index: int) -> float:
            return factor(min(index, end))

        return held
    return functools.partial(_held, factor, end)


def _held(factor: Any, end: int, index: int) -> float:
    return factor(min(index, end))
