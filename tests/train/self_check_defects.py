"""Generated classes with planted defects of the kinds the start-up self-check exists for (module level, so that the
gloo ranks of ``tests/dist_utils`` can unpickle them), and the workers that run the check with them."""

from __future__ import annotations

import contextlib
import io

import torch
import transformers

from runtime.diffusion.registry import training_class
from runtime.models.registry import causal_lm_class
from runtime.parallel.state import get_parallel_state

Qwen3 = causal_lm_class("qwen3")


class DoubledSPLoss(Qwen3):
    """Under SP, each rank's loss carries the gradient of the whole SP group's loss instead of its share (a loss
    reduction whose backward sums over the group again): the gradient shares, summed over the group by FSDP, come out
    ``sp`` times the true gradient, while the loss every rank logs keeps its right value."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        sp = get_parallel_state().sp_size
        if out.loss is not None and sp > 1:
            out.loss = out.loss + (sp - 1) * (out.loss - out.loss.detach())
        return out


class _RunningMean(torch.nn.Module):
    """A per-token MLP followed by a causal running mean over the whole row: state carried across positions with
    no document boundary (as a linear-attention recurrence over packed rows)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.mlp(hidden_states)
        return out.cumsum(dim=1) / torch.arange(1, out.shape[1] + 1, dtype=out.dtype, device=out.device).view(1, -1, 1)


class RecurrentQwen3(Qwen3):
    """The generated qwen3 with layer 0's MLP carrying state along the row (``_RunningMean``)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model.layers[0].mlp = _RunningMean(self.model.layers[0].mlp)


class RecurrentUpstreamQwen3(transformers.Qwen3ForCausalLM):
    """Upstream's qwen3 with the same change (the proof compares the two classes too), built as the proof builds
    upstream (an Auto class's ``from_config``)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model.layers[0].mlp = _RunningMean(self.model.layers[0].mlp)

    @classmethod
    def from_config(cls, config, **kwargs):
        return cls._from_config(config, **kwargs)


def job_config(model_type: str = "qwen3", **values) -> transformers.PretrainedConfig:
    """A real-sized job config of ``model_type`` (the transformers defaults plus ``values``), sdpa attention."""
    config = transformers.AutoConfig.for_model(model_type, use_cache=False, **values)
    config._attn_implementation = "sdpa"
    return config


def check_worker(
    rank: int, world_size: int, raw: dict, model_class: type | None, values: dict, upstream_class: type | None = None
) -> tuple[str, str]:
    """Run the self-check of run config ``raw`` on a job config of ``values`` with ``model_class`` (and
    ``upstream_class``): (rank 0's stdout, the error it raised or "")."""
    from runtime.config.errors import ConfigError
    from runtime.moe.dispatch import register_experts_kernels
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import setup_parallel
    from runtime.train.self_check_job import self_check

    register_experts_kernels()
    config = parse_config(raw)
    state = setup_parallel(config)
    job = job_config(config.model.type, **config.model.config, **values)
    job._experts_implementation = config.model.experts_implementation  # what build_model sets
    out, error = io.StringIO(), ""
    classes = {} if model_class is None else {"model_class": model_class}
    classes.update({} if upstream_class is None else {"upstream_class": upstream_class})
    try:
        with contextlib.redirect_stdout(out):
            self_check(config, state, _job_model(job), **classes)
    except ConfigError as exc:
        error = str(exc)
    finally:
        set_parallel_state(None)
    return out.getvalue(), error


def train_printing_worker(rank: int, world_size: int, raw: dict) -> tuple[str, list[float]]:
    """Train with ``raw``: (this rank's stdout, the per-step losses)."""
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import train

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = train(parse_config(raw))
    finally:
        set_parallel_state(None)
    return out.getvalue(), [m.loss for m in result.metrics]


def dit_check_worker(
    rank: int, world_size: int, model_type: str, parallel: dict, values: dict, model_class: type | None = None
) -> tuple[str, str]:
    """The DiT proof of ``model_type``'s tiny config with ``values`` over it, under ``parallel`` (init_parallel_state
    keywords): (the start-up line, or the error it raised)."""
    from runtime.config.errors import ConfigError
    from runtime.diffusion.registry import lookup_dit, training_class
    from runtime.parallel.parallelize import ParallelPlan
    from runtime.parallel.state import init_parallel_state, set_parallel_state
    from runtime.train.job import site_plan
    from runtime.train.self_check import run_proof
    from runtime.train.self_check_dit import prove_dit

    state = init_parallel_state(**parallel)
    cls = training_class(model_type)
    job = cls.config_class(**{**lookup_dit(model_type).tiny, **values})
    lines: list[str] = []
    try:
        run_proof(
            lambda: prove_dit(model_type, ParallelPlan(**site_plan(model_type)), state, job, model_class=model_class),
            "train.self_check",
            lines.append,
            state.loss_group,
        )
    except ConfigError as exc:
        return "", str(exc)
    finally:
        set_parallel_state(None)
    return lines[0], ""


WanShell = training_class("wan")


class DoubledSPGradientDiT(WanShell):
    """Under SP, the prediction's gradient comes back ``sp`` times (a gather whose backward sums what every rank
    already holds): the values, and so the loss every rank logs, are unchanged."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        sp = get_parallel_state().sp_size
        if sp == 1:
            return out
        prediction = out[0]
        return (prediction + (sp - 1) * (prediction - prediction.detach()), *out[1:])


def _job_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """A stand-in for the job's built model: the proof reads its config; the census's watchers find no module in it
    (the job's own model is not built here: the proof builds its shrunk copy)."""
    holder = torch.nn.Module()
    holder.config = config
    return holder
