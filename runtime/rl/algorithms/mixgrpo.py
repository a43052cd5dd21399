"""MixGRPO (Li et al. 2025, arXiv:2507.21802) as an algorithm of ``runtime.rl``: mixed ODE/SDE sampling whose SDE
window slides over training. The objective, advantages and SDE step are Flow-GRPO's
(``runtime/rl/algorithms/flowgrpo.py``); what changes is which steps are stochastic and trained on.

Why. Flow-GRPO draws a window per sample, anywhere in the schedule; MixGRPO trains every sample of an iteration on
the same window ``[l, l + w)`` (SDE inside, the deterministic ODE outside) and moves ``l`` over training, so the
optimisation works through the high-noise steps first and the cost of an iteration is ``w`` trained steps
whatever the schedule's length. The window (the paper's "sliding window" with size ``w``, shift interval
``tau`` and stride ``s``; ``lo, hi``: the first and last eligible start, ``window_range``)::

    progressive:  p = floor((k - 1) / tau)                        k: the iteration, 1-based
                  m = floor((hi - lo) / s) + 1                    positions lo, lo + s, ..., <= hi
                  l_k = lo + s * (p mod m)        roll_back: true (back to lo after the last position)
                  l_k = lo + s * min(p, m - 1)    roll_back: false (stays at the last position)
    verl_omni:    l_k = min(lo + w * floor(k / tau), hi)        verl-omni's progressive window (its
                  rollout adapter's sliding start): k counts from 1, so with tau = 1 the first position lo is never
                  trained; the start moves by the window size w and is clamped to hi, which lies off the w grid
                  when (hi - lo) is not a multiple of w. No progressive setting of ours equals it (window_stride = w,
                  roll_back: false differs at every iteration with tau = 1)
    random:       l_k uniform in [lo, hi], drawn from a generator seeded by (window_seed, k) alone
    exp_decay:    as progressive, but the window stays tau(l) = ceil(tau_0 * exp(-decay_k * max(0, l - decay_start)))
                  iterations at start l (tau_0 = iters_per_group): it moves faster through the later, low-noise
                  steps (the paper's exponential-decay shift interval)

``l_k`` is a function of the iteration alone, so every rank and a resumed run use the same window. The window start
is logged as ``window_start`` every iteration. (The Flash variant's higher-order ODE solver outside the window is
not taken: the ODE steps stay Euler, bitwise the sampler's.) The authors' code (Tencent-Hunyuan/MixGRPO,
``grpo_states.py``) lets the start run on to ``N - 2`` with the window cut at the schedule's end; here every
position keeps ``w`` steps (starts up to ``N - w``), so every iteration trains ``w`` steps.

Config: every ``flowgrpo:`` key (same meaning; ``window_range`` bounds the starts the window slides over) under
``mixgrpo:``, plus (defaults: the paper's Flux recipe)::

    mixgrpo:
      sample_strategy: progressive  # progressive (the sliding window) | random (a seeded window per iteration)
                                 # | exp_decay (the sliding window, its shift interval decaying with the start)
                                 # | verl_omni (verl-omni's progressive window, above)
      iters_per_group: 25        # tau (tau_0 for exp_decay): iterations at each window position
      decay_k: 0.1               # exp_decay: the decay rate (the authors' exp_decay_k)
      decay_start: 13            # exp_decay: the start from which tau decays (the authors' exp_decay_thre_timestep)
      window_stride: 1           # s: steps the window moves each time (verl-omni moves by window_size)
      roll_back: true            # progressive: after the last position start again from the first
      window_seed: 0             # random: the window draws' seed (independent of the sampling seeds)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.sections import KeyRules
from runtime.rl.algorithms import flowgrpo

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig

__all__ = ["ALGORITHM", "MixGRPO", "RULES", "Settings", "check", "conventions", "window", "window_start"]

NAME = "mixgrpo"


@dataclass(frozen=True)
class Settings(flowgrpo.Settings):
    sample_strategy: str = "progressive"
    iters_per_group: int = 25
    window_stride: int = 1
    roll_back: bool = True
    window_seed: int = 0
    decay_k: float = 0.1
    decay_start: int = 13


RULES = flowgrpo.rules_as(NAME).merged(
    KeyRules(
        positive=frozenset({f"{NAME}.iters_per_group", f"{NAME}.window_stride"}),
        non_negative=frozenset({f"{NAME}.window_seed", f"{NAME}.decay_k", f"{NAME}.decay_start"}),
        choices={f"{NAME}.sample_strategy": ("progressive", "random", "exp_decay", "verl_omni")},
    )
)
advantages = flowgrpo.advantages
step_objective = flowgrpo.step_objective


def check(config: RLConfig) -> None:
    """Flow-GRPO's checks under this section's name."""
    flowgrpo.check_as(NAME, config)


def window_start(settings: Settings, num_steps: int, step: int) -> int:
    """The window start ``l_k`` of iteration ``step`` (1-based) over a schedule of ``num_steps`` steps."""
    _, (lo, hi) = flowgrpo.window(settings, num_steps)
    if settings.sample_strategy == "random":
        digest = hashlib.sha256(f"patchgen.rl.mixgrpo.window:{settings.window_seed}:{step}".encode()).digest()
        return lo + int.from_bytes(digest[:8], "little") % (hi - lo + 1)
    if settings.sample_strategy == "verl_omni":  # window_stride and roll_back do not apply
        return min(lo + settings.window_size * (step // settings.iters_per_group), hi)
    count = (hi - lo) // settings.window_stride + 1
    if settings.sample_strategy == "exp_decay":
        return lo + settings.window_stride * _decayed_position(settings, lo, count, step)
    position = (step - 1) // settings.iters_per_group
    position = position % count if settings.roll_back else min(position, count - 1)
    return lo + settings.window_stride * position


def _decayed_position(settings: Settings, lo: int, count: int, step: int) -> int:
    """The position index of iteration ``step`` when position ``j`` (start ``l = lo + s j``) lasts ``tau(l)``."""
    durations = [
        max(
            1,
            math.ceil(
                settings.iters_per_group
                * math.exp(-settings.decay_k * max(0, lo + settings.window_stride * j - settings.decay_start))
            ),
        )
        for j in range(count)
    ]
    done = step - 1
    if not settings.roll_back and done >= sum(durations[:-1]):
        return count - 1
    done %= sum(durations)  # roll_back: the sweep repeats
    for j, duration in enumerate(durations):
        if done < duration:
            return j
        done -= duration
    raise AssertionError("unreachable: done < sum(durations)")


def window(settings: Settings, num_steps: int, step: int) -> tuple[int, tuple[int, int]]:
    """(window size, inclusive range of window starts) of iteration ``step``: one start for every sample."""
    start = window_start(settings, num_steps, step)
    return settings.window_size, (start, start)


def iteration_metrics(settings: Settings, num_steps: int, step: int) -> dict[str, int]:
    return {"window_start": window_start(settings, num_steps, step)}


def conventions(settings: Settings) -> str:
    if settings.sample_strategy == "random":
        moves = f"window random per iteration (seed {settings.window_seed})"
    elif settings.sample_strategy == "verl_omni":
        moves = (
            f"window start min(lo + {settings.window_size} floor(k / {settings.iters_per_group}), hi), k from 1 "
            "(verl-omni's progressive window)"
        )
    else:
        end = "rolls back" if settings.roll_back else "stays at the last position"
        every = f"every {settings.iters_per_group} iterations"
        if settings.sample_strategy == "exp_decay":
            every += f" x exp(-{settings.decay_k:g} (start - {settings.decay_start})+)"
        moves = f"window slides by {settings.window_stride} {every}, then {end}"
    return f"{flowgrpo.conventions(settings)}, {moves}"


class MixGRPO(flowgrpo.FlowGRPO):
    """Flow-GRPO's objective on a window that moves with the iteration (the contract's ``window`` takes it)."""

    name = NAME
    Settings = Settings
    rules = RULES

    def check(self, config: RLConfig) -> None:
        check(config)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def window(self, settings: Settings, num_steps: int, step: int) -> tuple[int, tuple[int, int]]:
        return window(settings, num_steps, step)

    def iteration_metrics(self, settings: Settings, num_steps: int, step: int) -> dict[str, int]:
        return iteration_metrics(settings, num_steps, step)


ALGORITHM = MixGRPO()
