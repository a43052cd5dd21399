"""Flow-matching SDE step with a log-probability (the Flow-GRPO policy), in fp32.

Conventions are diffusers' ``FlowMatchEulerDiscreteScheduler``: ``sigmas`` has ``N + 1`` entries, decreasing, the
last one 0; ``timesteps = sigmas[:-1] * num_train_timesteps``; the model predicts the velocity ``v = eps - x0`` of
``x_t = (1 - t) x0 + t eps``; the Euler ODE step is ``x + v * (sigma_{i+1} - sigma_i)``.

* ``make_schedule`` is the ONE function that builds a (shifted) sigma schedule (also a multistep scheduler's
  ``use_flow_sigmas`` grid, e.g. Wan2.1's UniPC: its own sigmas). Rollout and training both call it,
  so they cannot disagree; it delegates to diffusers' own ``set_timesteps`` so it cannot disagree with diffusers
  either.
* Steps are addressed by integer index. ``FlowMatchSchedule.index_for_timestep`` maps float timesteps back to
  indices only as a checked fallback: the nearest schedule entry, and a ``ValueError`` when it is farther than a
  tolerance (never exact float equality, never a silent wrong step).
* ``sde_step`` returns ``(prev_sample, log_prob, prev_sample_mean, std_dev_t, sqrt_dt)``. The Gaussian policy of
  a step is always ``N(prev_sample_mean, (std_dev_t * sqrt_dt) ** 2)`` elementwise, for both methods.

Method ``"sde"`` (Flow-GRPO), with ``d = sigma_{i+1} - sigma_i < 0`` and noise level ``a``::

    std_dev_t = a * sqrt(sigma / (1 - sigma'))        sigma' = sigmas[1] if sigma == 1 else sigma
    mean      = x * (1 + std_dev_t**2 * d / (2 sigma)) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 sigma)) * d
    sqrt_dt   = sqrt(-d)

This is the Euler-Maruyama step of the reverse SDE ``dx = [v + std^2/(2t) (x + (1-t) v)] dt + std dw`` whose
marginals equal the ODE's (``-(x + (1 - t) v) / t`` is the score of a rectified flow).

Method ``"dance"`` (DanceGRPO, Xue et al. 2025, arXiv:2505.07818): the same reverse SDE with a constant diffusion
coefficient ``eps_t = a`` instead of Flow-GRPO's ``a * sqrt(sigma / (1 - sigma))``, i.e. ``std_dev_t = a`` in the
two lines above (``dz = [v - a^2 / 2 * score] dt + a dw``, ``score = -(x + (1 - t) v) / t``).

Method ``"cps"`` (coefficient-preserving sampling, Wang & Yu 2025), with ``x0 = x - sigma v`` and
``eps = x + (1 - sigma) v`` the model's estimates of data and noise::

    std_dev_t = sigma_{i+1} * sin(a * pi / 2)         sqrt_dt = 1
    mean      = (1 - sigma_{i+1}) x0 + sqrt(sigma_{i+1}**2 - std_dev_t**2) eps

Why: the "sde" step's noise is ``std * sqrt(-d)`` on top of a mean whose noise coefficient is not reduced to
compensate, so with a large ``a`` and few steps the sample carries more noise than ``sigma_{i+1}`` says it should
(visibly noisy images). CPS is DDIM-with-eta for flows: the deterministic part keeps a noise coefficient
``sqrt(sigma'^2 - std^2)`` and the fresh noise adds ``std^2``, so the total noise coefficient is exactly
``sigma_{i+1}`` at every step. At ``a = 0`` it is the Euler step (in exact arithmetic; not bitwise). Unlike the
reference implementation, which keeps only ``-(x - mean)^2`` as the "log-prob", we return the full Gaussian
log-density for both methods (the constants cancel in ratios; the KL needs the true std anyway).

Degenerate steps (total std 0: noise level 0, or CPS onto ``sigma = 0``) are deterministic: ``prev_sample`` is the
mean and ``log_prob`` is 0 (with finite gradients).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import ConfigMixin

SdeMethod = Literal["sde", "cps", "dance"]
CpsLogProb = Literal["squared_error", "gaussian"]
CPS_LOG_PROBS = ("squared_error", "gaussian")  # the first is verl-omni's (the default)
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))

__all__ = [
    "CPS_LOG_PROBS",
    "CpsLogProb",
    "FlowMatchSchedule",
    "SdeMethod",
    "euler_step",
    "gaussian_log_prob",
    "make_schedule",
    "sde_step",
]


@dataclass(frozen=True)
class FlowMatchSchedule:
    """An inference schedule: ``sigmas`` (fp32, ``N + 1``, last 0) and ``timesteps`` (fp32, ``N``)."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    num_train_timesteps: int

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    def index_for_timestep(self, timestep: float | torch.Tensor, atol: float | None = None) -> torch.Tensor:
        """The step index of each timestep: the nearest schedule entry, checked to be within ``atol``.

        ``atol`` defaults to a quarter of the smallest gap between neighbouring timesteps (so a timestep can never
        be taken for its neighbour) and at most 1e-3 of ``num_train_timesteps``. Raises ``ValueError`` naming the
        offending timestep when it is not in the schedule.
        """
        t = torch.as_tensor(timestep, dtype=torch.float64).reshape(-1)
        ref = self.timesteps.to(torch.float64)
        if atol is None:
            gaps = (ref[:-1] - ref[1:]).abs()
            atol = 1e-3 * self.num_train_timesteps
            if gaps.numel():
                atol = min(atol, 0.25 * gaps.min().item())
        dist = (t[:, None].cpu() - ref[None, :].cpu()).abs()
        best, index = dist.min(dim=1)
        bad = best > atol
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"timestep {t[i].item()!r} is not in the schedule (nearest {ref[index[i]].item()!r} at index "
                f"{int(index[i])}, distance {best[i].item():.3g} > atol {atol:.3g}); address steps by index"
            )
        return index

    def to(self, device: torch.device | str) -> FlowMatchSchedule:
        return FlowMatchSchedule(self.sigmas.to(device), self.timesteps.to(device), self.num_train_timesteps)


def make_schedule(
    scheduler_or_config: FlowMatchEulerDiscreteScheduler | Mapping[str, Any] | None,
    num_inference_steps: int,
    *,
    mu: float | None = None,
    sigmas: Sequence[float] | None = None,
    device: torch.device | str | None = None,
) -> FlowMatchSchedule:
    """The shifted sigma schedule of ``num_inference_steps`` steps, exactly as diffusers builds it.

    ``scheduler_or_config``: a ``FlowMatchEulerDiscreteScheduler`` (its config is used; the instance is not
    touched), its config mapping (e.g. ``{"shift": 3.0}``), or None for the defaults. ``mu`` is the
    resolution-dependent shift, required when the config has ``use_dynamic_shifting``. ``sigmas``: the unshifted
    sigmas a pipeline passes to ``set_timesteps`` (Flux and Qwen-Image pass ``linspace(1, 1 / N, N)``, which is
    not the scheduler's own grid); the scheduler shifts them as it does in that pipeline.
    """
    if isinstance(scheduler_or_config, ConfigMixin):  # its config holds no _class_name (scheduler_config.json does)
        config = {**scheduler_or_config.config, "_class_name": type(scheduler_or_config).__name__}
    else:
        config = dict(scheduler_or_config or {})
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
    name = config.get("_class_name", FlowMatchEulerDiscreteScheduler.__name__)
    if name != FlowMatchEulerDiscreteScheduler.__name__:
        return _flow_sigmas_schedule(name, config, num_inference_steps, mu, sigmas, device)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    if scheduler.config.invert_sigmas:
        raise ValueError("invert_sigmas schedules are not supported by the Flow-GRPO SDE step")
    kwargs = {"mu": mu} if mu is not None else {}
    if sigmas is not None:
        if len(sigmas) != num_inference_steps:
            raise ValueError(f"got {len(sigmas)} sigmas for {num_inference_steps} inference steps")
        scheduler.set_timesteps(sigmas=[float(s) for s in sigmas], device=device, **kwargs)
    else:
        scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)
    sigmas = scheduler.sigmas.to(torch.float32)
    timesteps = scheduler.timesteps.to(torch.float32)
    return FlowMatchSchedule(sigmas, timesteps, int(scheduler.config.num_train_timesteps))


def _flow_sigmas_schedule(
    name: str,
    config: dict[str, Any],
    num_inference_steps: int,
    mu: float | None,
    sigmas: Sequence[float] | None,
    device: torch.device | str | None,
) -> FlowMatchSchedule:
    """The grid of a multistep scheduler with ``use_flow_sigmas`` (Wan2.1's ``UniPCMultistepScheduler``, Sana's
    ``DPMSolverMultistepScheduler``): its own ``set_timesteps`` sigmas (shifted by its ``flow_shift``), which
    ``FlowMatchEulerDiscreteScheduler.from_config`` would read as an unshifted grid (it ignores ``flow_shift``).
    The SDE steps on these sigmas; ``timesteps = sigmas[:-1] * num_train_timesteps`` as above (the pipeline rounds
    its timesteps to integers: 999 where this gives 1000.0). Any other scheduler is refused: its steps are not
    flow-matching ones."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None or not config.get("use_flow_sigmas"):
        raise ValueError(
            f"scheduler {name}: the Flow-GRPO SDE step needs a flow-matching schedule "
            f"(FlowMatchEulerDiscreteScheduler, or a multistep scheduler with use_flow_sigmas: true)"
        )
    if sigmas is not None:
        raise ValueError(f"scheduler {name}: its pipelines pass no sigmas of their own (got {len(sigmas)})")
    scheduler = cls.from_config(config)
    kwargs = {"mu": mu} if mu is not None and config.get("use_dynamic_shifting") else {}
    scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)
    grid = scheduler.sigmas.to(device=device, dtype=torch.float32)
    if grid.shape != (num_inference_steps + 1,) or grid[-1] != 0:
        raise ValueError(f"scheduler {name}: expected {num_inference_steps} sigmas and a final 0, got {grid.tolist()}")
    return FlowMatchSchedule(grid, grid[:-1] * config["num_train_timesteps"], int(config["num_train_timesteps"]))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2)`` averaged over the non-batch dims (``torch.distributions.Normal``'s form).

    Rows whose ``std`` is 0 get log-prob 0 (deterministic step) with finite gradients.
    """
    std = std.expand_as(mean) if std.ndim else std.expand(mean.shape)
    ok = std > 0
    safe = torch.where(ok, std, torch.ones_like(std))
    lp = -((x - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _LOG_SQRT_2PI
    lp = torch.where(ok, lp, torch.zeros_like(lp))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def _per_sample(value: float | torch.Tensor, batch: int, ndim: int, device: torch.device) -> torch.Tensor:
    """A scalar or per-sample value as an fp32 ``[B, 1, ..., 1]`` tensor (broadcasts against the sample)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"expected a scalar or a per-sample tensor of shape ({batch},), got {tuple(t.shape)}")
    return t.reshape((batch,) + (1,) * (ndim - 1))


def _noise(
    shape: torch.Size, generator: torch.Generator | Sequence[torch.Generator] | None, device: torch.device
) -> torch.Tensor:
    """fp32 standard normal noise; a list of generators draws each sample's noise from its own generator."""
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        return torch.randn(shape, generator=generator, dtype=torch.float32, device=gen_device).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
    rows = [torch.randn(shape[1:], generator=g, dtype=torch.float32, device=g.device) for g in generator]
    return torch.stack(rows).to(device)


def euler_step(schedule: FlowMatchSchedule, step_index: int, sample: torch.Tensor, velocity: torch.Tensor):
    """The deterministic flow-matching ODE step ``x + v * (sigma_{i+1} - sigma_i)`` in fp32."""
    sigmas = schedule.sigmas.to(sample.device)
    d = sigmas[step_index + 1] - sigmas[step_index]
    return sample.float() + velocity.float() * d


def sde_step(
    schedule: FlowMatchSchedule,
    sample: torch.Tensor,
    model_output: torch.Tensor,
    *,
    step_index: int | torch.Tensor | None = None,
    timestep: float | torch.Tensor | None = None,
    noise_level: float | torch.Tensor = 0.7,
    method: SdeMethod = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    cps_log_prob: CpsLogProb = "squared_error",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stochastic step ``sigmas[i] -> sigmas[i + 1]``; returns ``(prev_sample, log_prob, mean, std, sqrt_dt)``.

    ``step_index`` (an int, or a ``[B]`` long tensor for samples at different steps) addresses the step;
    ``timestep`` is the checked fallback (see ``FlowMatchSchedule.index_for_timestep``). ``noise_level`` is a float
    or a ``[B]`` tensor (0 rows take the ODE step). With ``prev_sample`` given (training-side recomputation) no
    noise is drawn and ``log_prob`` is the log-density of that sample; otherwise the noise comes from
    ``generator`` (one, or one per sample). Everything is computed in fp32; ``log_prob`` has shape ``[B]`` (mean over
    the non-batch dims); ``std_dev_t`` and ``sqrt_dt`` have shape ``[B, 1, ..., 1]``. ``cps_log_prob`` picks the
    CPS log-prob convention (see the module docstring).
    """
    if (step_index is None) == (timestep is None):
        raise ValueError("pass exactly one of step_index and timestep")
    if method not in ("sde", "cps", "dance"):
        raise ValueError(f"unknown SDE method {method!r}; expected 'sde', 'cps' or 'dance'")
    if cps_log_prob not in CPS_LOG_PROBS:
        raise ValueError(f"unknown CPS log-prob {cps_log_prob!r}; expected one of {', '.join(CPS_LOG_PROBS)}")
    device = sample.device
    x = sample.float()
    v = model_output.float()
    batch, ndim = x.shape[0], x.ndim
    sigmas = schedule.sigmas.to(device)
    if step_index is None:
        step_index = schedule.index_for_timestep(timestep).to(device)
        if step_index.numel() == 1:
            step_index = step_index.reshape(())
    index = torch.as_tensor(step_index, dtype=torch.long, device=device)
    if index.ndim == 0:
        index = index.expand(batch)
    if index.shape != (batch,):
        raise ValueError(f"step_index must be an int or a ({batch},) tensor, got shape {tuple(index.shape)}")
    if bool(((index < 0) | (index >= schedule.num_steps)).any()):
        raise IndexError(f"step_index out of range [0, {schedule.num_steps}): {index.tolist()}")
    shape = (batch,) + (1,) * (ndim - 1)
    sigma = sigmas[index].reshape(shape)
    sigma_next = sigmas[index + 1].reshape(shape)
    a = _per_sample(noise_level, batch, ndim, device)

    if method in ("sde", "dance"):
        dt = sigma_next - sigma
        if method == "sde":
            sigma_den = torch.where(sigma == 1, sigmas[1], sigma)
            std_dev_t = torch.sqrt(sigma / (1 - sigma_den)) * a
        else:
            std_dev_t = a.expand_as(sigma)
        mean = x * (1 + std_dev_t**2 * dt / (2 * sigma)) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        sqrt_dt = torch.sqrt(-dt)
    else:
        std_dev_t = sigma_next * torch.sin(a * (math.pi / 2))
        x0 = x - sigma * v
        eps = x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0 + torch.sqrt(torch.clamp(sigma_next**2 - std_dev_t**2, min=0)) * eps
        sqrt_dt = torch.ones_like(sigma)

    std = std_dev_t * sqrt_dt
    if prev_sample is None:
        noise = _noise(x.shape, generator, device)
        prev = torch.where(std > 0, mean + std * noise, mean)
    else:
        if prev_sample.shape != x.shape:
            raise ValueError(f"prev_sample shape {tuple(prev_sample.shape)} != sample shape {tuple(x.shape)}")
        prev = prev_sample.float()
    if method == "cps" and cps_log_prob == "squared_error":
        log_prob = -((prev.detach() - mean) ** 2).mean(dim=tuple(range(1, ndim)))
    else:
        log_prob = gaussian_log_prob(prev.detach(), mean, std)
    return prev, log_prob, mean, std_dev_t, sqrt_dt
