"""The start-up summary of a training run, printed by rank 0 before anything slow happens (a user sees at once what
runs where, and what is loading while it loads), and the model's size once it is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.parallel.precision import compute_dtype
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig

__all__ = ["expert_summary", "model_summary", "plan_summary", "run_summary", "say"]


def say(state: ParallelState, line: str) -> None:
    """``line`` on rank 0's stdout, at once."""
    if state.rank == 0:
        print(line, flush=True)


def run_summary(config: RunConfig, state: ParallelState) -> str:
    """What this training run is, from its config and layout alone: the model and where it starts from, the data,
    then ``plan_summary``."""
    start = f"from {config.model.path}" if config.model.path else "random init"
    return f"run: {config.model.type} ({start}) on {config.data.path} | {plan_summary(config, state)}"


def plan_summary(config: RunConfig | RLConfig, state: ParallelState) -> str:
    """The part of a start-up summary every job shares: the layout of the processes, the compute dtype, LoRA and
    activation checkpointing, the steps and where logs, checkpoints and the export go."""
    p, c = config.parallel, config.checkpoint
    layout = (
        f"{state.world_size} process(es) = dp_replicate {state.dp_replicate_size} x dp_shard {state.dp_shard_size} "
        f"x sp {state.sp_size}"
        + (f" (ulysses {state.ulysses_size} x ring {state.ring_size})" if state.ring_size > 1 else "")
        + (f", ep {state.ep_size}" if state.ep_size > 1 else "")
    )
    dtype = str(compute_dtype(config.train.mixed_precision, state.device_type)).removeprefix("torch.")
    checkpoints = f"{c.dir} every {c.interval} steps" if c.dir and c.interval else (c.dir or "none")
    extras = [f"LoRA rank {config.lora.rank}"] if config.lora.rank else []
    extras += ["activation checkpointing"] if p.activation_checkpointing else []
    expert = expert_summary(config)
    return (
        f"{layout} on {state.device_type} | compute {dtype} (train.mixed_precision {config.train.mixed_precision})"
        f"{''.join(', ' + e for e in extras)} | {config.train.steps} steps | logs {config.log.dir}, checkpoints "
        f"{checkpoints}, export {config.export.dir or 'none'}" + (f" | {expert}" if expert else "")
    )


def expert_summary(config: Any) -> str | None:
    """``training expert: transformer_2 (low noise, t < 875)`` when ``model.path`` holds two experts switched at
    ``boundary_ratio`` (Wan2.2 A14B) and ``dit.condition.expert`` names one: which half of the schedule this job
    changes. None otherwise, also when the files cannot tell (the checks that follow say why)."""
    expert = (getattr(getattr(config, "dit", None), "condition", None) or {}).get("expert")
    path = getattr(config.model, "path", None)
    if expert not in ("transformer", "transformer_2") or not path:
        return None
    try:
        index = json.loads((Path(path) / "model_index.json").read_text())
        scheduler = json.loads((Path(path) / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(scheduler, dict):
        return None
    ratio, steps = index.get("boundary_ratio"), scheduler.get("num_train_timesteps", 1000)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (ratio, steps))
    second = index.get("transformer_2")
    if not numbers or not isinstance(second, list) or not second or second[0] is None:
        return None
    where = "high noise, t >= " if expert == "transformer" else "low noise, t < "
    return f"training expert: {expert} ({where}{ratio * steps:g})"


def model_summary(model: torch.nn.Module, samples: int) -> str:
    """The built model's parameter counts (global sizes: sharded parameters count whole) and the data's size."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"model: {total:,} parameters, {trained:,} trained | data: {samples:,} samples"
