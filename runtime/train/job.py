"""What a model family hands the shared training loop (``runtime/train/loop.py``): a ``Job`` whose step work is a
``StepWork``, and the device/reduction helpers every family's forward/backward uses. Its own module so that a family
(``runtime/train/dit.py``) and the loop that dispatches to it import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.parallel.parallelize import ParallelPlan
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig
from runtime.train.metrics import MetricsLogger

__all__ = ["Job", "StepWork", "all_reduce_sum", "parallel_plan", "site_plan", "to_device", "train_device"]


@dataclass(frozen=True)
class StepWork:
    """What one step's forward/backward passes (all micro-batches) report to the shared loop."""

    loss: torch.Tensor  # the global loss of the step (every DP replica's share added up)
    count: int  # its denominator: valid target tokens (text) or latent tokens (DiT) of the global batch
    processed: int  # tokens the whole job processed in the step (tokens/s; TFLOP/s when ``flops`` is None)
    # This rank's loss of each micro-batch, and what each was made of (sample file:line, cache shard), described
    # only when the non-finite guard names a step's data (``runtime/train/finite.py``).
    micro_losses: Sequence[torch.Tensor] = ()
    describe: Callable[[], list[list[str]]] = field(default=lambda: [])
    # model FLOPs of the step, whole job, from its real documents (None: ``Job.flops_per_token`` x ``processed``)
    flops: float | None = None


@dataclass
class Job:
    """What a model family brings to the shared loop (``run_job``): the trained module, already on its device and
    sharded, its resumable data, the forward/backward of one step, and the export."""

    model: torch.nn.Module
    loader: Any  # state_dict() / load_state_dict(): the data position saved in checkpoints
    forward_backward: Callable[[int], StepWork]  # gradients of every micro-batch of step ``step``, accumulated
    flops_per_token: float
    export: Callable[[], None] | None = None
    checkpoint_model: torch.nn.Module | None = None  # what DCP saves when it is more than ``model`` (e.g. + EMA)
    after_optimizer_step: Callable[[], None] | None = None  # e.g. the EMA update
    # What checkpoints record and a resume must match (``runtime/checkpoint/identity.py``); default: model.type and
    # the config of ``model``.
    identity: dict[str, Any] | None = None
    evaluate: Callable[[], float] | None = None  # the eval set's loss now (``runtime/train/evaluate.py``); collective
    # Called on every rank after each step is logged (DiTs: validation samples, ``runtime/train/samples.py``)
    after_step: Callable[[int, MetricsLogger], None] | None = None
    samples_per_step: int | None = None  # samples of the global batch (DiTs), for the console's samples/s


def parallel_plan(config: RunConfig) -> ParallelPlan:
    """What the trainer asks of ``parallelize`` (``runtime/parallel/parallelize.py``), text and DiT alike."""
    return ParallelPlan(
        mixed_precision=config.train.mixed_precision,
        activation_checkpointing=config.parallel.activation_checkpointing,
        compile=config.train.compile,
        compile_backend=config.train.compile_backend,
        **site_plan(config.model.type),
    )


def site_plan(model_type: str) -> dict[str, Any]:
    """The plan's fields for the attention-site check (``runtime/parallel/sites.py``), from the model's record."""
    from runtime.models.registry import REGISTRY

    entry = REGISTRY.get(model_type)
    if entry is None:
        return {}
    return {"replicated_modules": entry.supports.replicated_modules, "model_name": entry.spec}


def all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return value


def train_device(state: ParallelState) -> torch.device:
    """This rank's GPU under NCCL (``init_parallel_state`` selected LOCAL_RANK's), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if state.device_type == "cuda" else torch.device("cpu")


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
