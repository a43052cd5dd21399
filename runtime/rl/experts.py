"""Wan2.2 A14B in ``runtime.rl``: a pipeline with two transformers switched at ``boundary_ratio`` (``WanPipeline``:
``transformer`` denoises the timesteps ``t >= boundary_ratio * num_train_timesteps``, ``transformer_2`` the rest).
One expert trains (``dit.condition.expert``, as in the trainer); the other is loaded frozen, and the rollout runs it
on its steps, so every trajectory is the pipeline's.

* ``expert_steps``: the schedule indices ``[lo, hi)`` the trained expert denoises, from the timesteps the pipeline
  compares: its scheduler's own after ``set_timesteps(N)`` as ``WanPipeline`` calls it (a multistep scheduler's are
  integers, not ``sigma * 1000``);
* ``ExpertSwitch``: the module of a step, for the adapter's ``velocity``: the module passed (the policy, or the
  reference of a KL term) on the trained expert's steps, the frozen other expert elsewhere;
* ``check_experts`` (preflight) and ``fit_window`` (every iteration): the SDE window starts restricted to those whose
  whole window lies in the trained expert's steps, so every trained step is one the trained expert denoises; the
  algorithms that train anything else than the rollout's window steps are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runtime.config.errors import ConfigError
from runtime.diffusion.conditions.wan import EXPERTS  # high noise, low noise

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig
    from runtime.rl.sampling.scheduler import FlowMatchSchedule

__all__ = ["ExpertSwitch", "check_experts", "expert_steps", "fit_window", "other_expert", "pipeline_timesteps"]


def other_expert(expert: str) -> str:
    """The folder of the expert that is not ``expert``."""
    return EXPERTS[1 - EXPERTS.index(expert)]


def pipeline_timesteps(scheduler: Any, num_steps: int) -> torch.Tensor:
    """The timesteps ``WanPipeline`` loops over: a fresh scheduler of ``scheduler``'s config after the pipeline's
    ``set_timesteps(num_steps)`` call."""
    fresh = type(scheduler).from_config(scheduler.config)
    fresh.set_timesteps(num_steps)
    return fresh.timesteps


def expert_steps(scheduler: Any, boundary_ratio: float, expert: str, num_steps: int) -> tuple[int, int]:
    """``[lo, hi)``: the steps of a ``num_steps``-step schedule that ``WanPipeline`` runs ``expert`` on, each of its
    timesteps compared with the boundary as the pipeline compares it (``t >= boundary_timestep``: ``transformer``)."""
    timesteps = pipeline_timesteps(scheduler, num_steps)
    boundary_timestep = boundary_ratio * scheduler.config.num_train_timesteps
    high = [bool(t >= boundary_timestep) for t in timesteps]
    first_low = sum(high)
    if len(high) != num_steps or high != [True] * first_low + [False] * (num_steps - first_low):
        raise ValueError(f"the {num_steps}-step schedule's timesteps {timesteps.tolist()} do not decrease")
    return (0, first_low) if expert == "transformer" else (first_low, num_steps)


@dataclass
class ExpertSwitch:
    """The frozen ``other`` expert and which steps are the trained ``expert``'s (``boundary_ratio``, the pipeline's
    ``scheduler``)."""

    other: nn.Module
    expert: str
    boundary_ratio: float
    scheduler: Any
    _known: dict[int, tuple[torch.Tensor, tuple[int, int]]] = field(default_factory=dict, repr=False)
    _checked: Any = field(default=None, repr=False)  # the last schedule found to be the pipeline's (checked once)

    def _pipeline(self, num_steps: int) -> tuple[torch.Tensor, tuple[int, int]]:
        if num_steps not in self._known:
            timesteps = pipeline_timesteps(self.scheduler, num_steps).double()
            steps = expert_steps(self.scheduler, self.boundary_ratio, self.expert, num_steps)
            self._known[num_steps] = (timesteps, steps)
        return self._known[num_steps]

    def steps(self, num_steps: int) -> tuple[int, int]:
        """``[lo, hi)``: the trained expert's steps of the pipeline's ``num_steps``-step schedule."""
        return self._pipeline(num_steps)[1]

    def module_at(self, module: nn.Module, schedule: FlowMatchSchedule, step_index: int | torch.Tensor) -> nn.Module:
        """``module`` where the trained expert denoises ``step_index``, else the frozen other expert. The schedule
        must be the pipeline's (its timesteps within 1 of the pipeline's: a multistep scheduler truncates them to
        integers), and every index of the call one expert's."""
        timesteps, (lo, hi) = self._pipeline(schedule.num_steps)
        if schedule is not self._checked:  # once per schedule (a rollout's), not per forward: no host sync each call
            gap = (schedule.timesteps.detach().cpu().double() - timesteps).abs().max().item()
            if gap > 1.0:
                raise ValueError(
                    f"the experts switch on the pipeline's {schedule.num_steps}-step schedule; this one's timesteps "
                    f"are {gap:.3g} away from it"
                )
            self._checked = schedule
        index = torch.as_tensor(step_index).reshape(-1).cpu()
        trained = (index >= lo) & (index < hi)
        if bool(trained.all()):
            return module
        if not bool(trained.any()):
            return self.other
        raise ValueError(
            f"step_index {index.tolist()} mixes steps of both experts (the trained {self.expert} denoises steps "
            f"{lo}..{hi - 1} of {schedule.num_steps}); one forward runs one expert: call it per expert"
        )


def _two_experts(path: str) -> dict[str, Any] | None:
    """The ``model_index.json`` of a pipeline with two transformers switched at ``boundary_ratio``, else None."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    two = index.get("transformer_2", [None])[0] is not None and index.get("boundary_ratio") is not None
    return index if two else None


def _check_algorithm(config: RLConfig, ratio: float) -> None:
    """Only an algorithm that trains the rollout's window steps, its window placed by its settings, keeps every
    trained step in one expert's range."""
    from runtime.rl.config import ALGORITHMS, algorithm

    algo = algorithm(config.algorithm)
    if algo.trains_on == "steps" and algo.window_keys:
        return
    why = {
        "clean_samples": "trains the forward process of the final samples at noise levels of its own",
        "pairs": "trains preference pairs at noise levels of its own",
        "steps": "trains steps anywhere in the schedule (its SDE window is the whole schedule)",
    }[algo.trains_on]
    fine = [n for n in ALGORITHMS if algorithm(n).trains_on == "steps" and algorithm(n).window_keys]
    raise ConfigError(
        f"algorithm: {config.algorithm} {why}, not the window steps of one expert of {config.model.path} (two "
        f"transformers switched at boundary_ratio {ratio}: Wan2.2 A14B); use {', '.join(fine)}, or a "
        f"one-transformer pipeline"
    )


def check_experts(config: RLConfig) -> tuple[int, int] | None:
    """Preflight of a pipeline with two experts (None for one transformer): ``dit.condition.expert`` set, the
    algorithm one that trains window steps, and every iteration's SDE window able to lie in the expert's steps.
    Returns those steps ``[lo, hi)``."""
    import diffusers

    from runtime.rl.config import algorithm
    from runtime.train.dit import transformer_folder

    index = _two_experts(config.model.path)
    if index is None:
        if config.sampling.true_cfg_scale_2 is not None:
            raise ConfigError(
                f"sampling.true_cfg_scale_2: {config.model.path} holds one transformer (the scale of transformer_2's "
                f"steps needs two experts: Wan2.2 A14B); remove it"
            )
        if config.dit.condition.get("expert") is not None:
            raise ConfigError(
                f"dit.condition.expert: {config.model.path} holds one transformer (no transformer_2 switched at "
                f"boundary_ratio: Wan2.2 A14B); remove expert"
            )
        return None
    expert = transformer_folder(config)  # refuses a missing expert in the trainer's words
    if expert not in EXPERTS:
        raise ConfigError(f"dit.condition.expert: expected one of {', '.join(EXPERTS)}, found {expert!r}")
    ratio = index["boundary_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio < 1:
        raise ConfigError(
            f"model.path: {config.model.path}/model_index.json: boundary_ratio {ratio!r} is not a number in (0, 1) "
            f"(WanPipeline runs transformer on the timesteps >= boundary_ratio x 1000); fix model_index.json"
        )
    _check_algorithm(config, ratio)
    try:
        scheduler = getattr(diffusers, index["scheduler"][1]).from_pretrained(config.model.path, subfolder="scheduler")
        steps = expert_steps(scheduler, ratio, expert, config.sampling.num_inference_steps)
    except (AttributeError, OSError, TypeError, ValueError) as exc:
        raise ConfigError(f"model.path: {config.model.path}/scheduler: {' '.join(str(exc).split())[:300]}") from None
    algo, n = algorithm(config.algorithm), config.sampling.num_inference_steps
    for step in range(1, config.train.steps + 1):  # MixGRPO's window moves with the iteration
        fit_window(config, steps, step, *algo.window(config.algo, n, step))
    return steps


def fit_window(
    config: RLConfig, steps: tuple[int, int] | None, step: int, size: int, starts: tuple[int, int]
) -> tuple[int, int]:
    """``starts`` (inclusive) narrowed to the windows of ``size`` steps that lie in ``steps`` (the trained expert's,
    None: every step); a ConfigError naming the keys when none does."""
    if steps is None:
        return starts
    from runtime.rl.config import algorithm

    lo, hi = steps
    first, last = max(starts[0], lo), min(starts[1], hi - size)
    if first <= last:
        return first, last
    name, n, expert = config.algorithm, config.sampling.num_inference_steps, config.dit.condition["expert"]
    keys = [f"{name}.{k}" for k in algorithm(name).window_keys]
    if hi == lo:
        where, change = f"denoises none of the {n} steps", "raise sampling.num_inference_steps"
    else:
        where = f"denoises steps {lo}..{hi - 1} of the {n}"
        if hi - lo < size:
            change = f"lower {keys[0]} to at most {hi - lo} or raise sampling.num_inference_steps"
        else:
            change = f"place the window starts within {lo}..{hi - size} ({', '.join(keys[1:] or keys)})"
    raise ConfigError(
        f"{keys[0]}: no SDE window of {size} step(s) starting in {starts[0]}..{starts[1]} (iteration {step}) lies "
        f"in the trained expert's steps: dit.condition.expert {expert!r} {where} (sampling.num_inference_steps); "
        f"{change}"
    )
