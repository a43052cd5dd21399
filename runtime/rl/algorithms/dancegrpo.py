"""DanceGRPO (Xue et al. 2025, arXiv:2505.07818) as an algorithm of ``runtime.rl``: every step of the rollout is
stochastic, under DanceGRPO's SDE; each sample trains on a random subset of its steps; the samples of a prompt
start from the same noise. The clipped objective and the KL are Flow-GRPO's (``runtime/rl/algorithms/flowgrpo.py``).

SDE (``sde_type: dance``, ``runtime/rl/sampling/scheduler.py``). The reverse-time SDE of a rectified flow with a
constant diffusion coefficient ``eps_t = noise_level`` (the paper's ``eta``)::

    dz = [v - eps_t^2 / 2 * score(z, t)] dt + eps_t dw,     score(z, t) = -(z - (1 - t) x0_hat) / t^2,
                                                             x0_hat = z - t v
    Euler-Maruyama, d = sigma_{i+1} - sigma_i < 0:
    mean = z + d * (v + eps_t^2 / (2 sigma) * (z + (1 - sigma) v)),   std = eps_t * sqrt(-d)

(Flow-GRPO's ``sde`` step is the same with ``eps_t = a * sqrt(sigma / (1 - sigma))``.) The step's policy is
``N(mean, std^2)``; its log-prob the per-element mean of the Gaussian log-density.

Timestep subsampling. Of the ``N`` steps (``N - 1`` with ``ignore_last``: the step onto ``sigma = 0`` is not
trained), each sample trains on ``K = max(1, floor(timestep_fraction * N'))`` distinct steps drawn without
replacement from a generator seeded by ``(model.seed, iteration, global sample)`` alone (resume and any layout draw
the same steps); the objective is the mean over those ``K`` steps and the batch.

Shared initial noise (``init_same_noise: true``). The ``group_size`` samples of a prompt start from one noise
tensor, drawn from a generator seeded by ``(model.seed, iteration, global group)``, so the group's rewards differ
only through the SDE noise and the advantage compares trajectories, not starting points.

KL to the reference (``kl_coef > 0``). The step's std is ``eta * sqrt(-d)``: verl-omni's ``dance_grpo`` keeps the
``sqrt(-d)`` inside its ``std_dev_t``, so its KL, ``mean((mean - ref)^2) / (2 std_dev_t^2)``, is the exact Gaussian
KL: ``kl_form: exact`` here (the default). ``kl_form: scaled`` divides by ``eta^2`` alone (Flow-GRPO's form, which
leaves out ``-d``): the exact KL times ``-d``, 0.10-0.14 of verl-omni's at 7-10 steps; no DanceGRPO peer uses it.
The authors' scripts train without a KL term.

Advantages. ``advantage_eps`` is the std's additive epsilon: 1e-4 (verl-omni's, the default) or the authors' 1e-8
(``train_grpo_flux.py``: ``(r - mean) / (std + 1e-8)``); only a group whose rewards are within ~1e-4 of each other
tells them apart.

Schedule. The rollout samples on the model's own schedule (its pipeline's shifted sigmas, as every algorithm
here); the authors' and verl-omni's DanceGRPO scripts sample on ``sd3_time_shift(3, linspace(1, 0, N + 1))``
whatever the model. Set the model's scheduler shift to 3 (Flux: a fixed ``shift: 3`` instead of its dynamic
shifting) to sample their grid.

Config (defaults: the paper's Flux recipe where it has one; ``advantage: group`` as its ``--use_group``)::

    dancegrpo:
      group_size: 4
      noise_level: 0.3           # eta
      sde_type: dance            # dance | sde (Flow-GRPO's eps_t) | cps
      timestep_fraction: 0.6     # share of the steps each sample trains on
      ignore_last: true          # the last step (onto sigma = 0) is not trained
      init_same_noise: true      # one starting noise per prompt group
      advantage: group           # global | group | none (Flow-GRPO's)
      advantage_std_ddof: 1
      advantage_eps: 1.0e-4      # the std's epsilon: 1e-4 (verl-omni) | 1e-8 (the DanceGRPO authors)
      clip_range: 1.0e-4
      policy_loss_mode: vanilla  # vanilla | gspo (Flow-GRPO's)
      gspo_clip_fraction: band   # band | verl (Flow-GRPO's)
      adv_clip_max: 5.0          # null: unclamped (verl's gspo)
      ratio_std_ddof: 0          # 0 (population) | 1 (verl-omni's torch.std)
      kl_coef: 0.0
      kl_form: exact             # exact (verl-omni's dance_grpo) | scaled (exact x -dt, Flow-GRPO's form)
      cps_log_prob: squared_error
      micro_batch_size: null
      inner_epochs: 1
      logprob_gap_alarm: 1.0e-3
      on_logprob_gap: warn
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms import flowgrpo

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = [
    "ALGORITHM",
    "DanceGRPO",
    "RULES",
    "Settings",
    "check",
    "conventions",
    "initial_noise",
    "step_objective",
    "train_positions",
    "window",
]

NAME = "dancegrpo"


@dataclass(frozen=True)
class Settings:
    group_size: int = 4
    noise_level: float = 0.3
    sde_type: str = "dance"
    timestep_fraction: float = 0.6
    ignore_last: bool = True
    init_same_noise: bool = True
    advantage: str = "group"
    advantage_std_ddof: int = 1
    advantage_eps: float = 1e-4
    clip_range: float = 1e-4
    policy_loss_mode: str = "vanilla"
    gspo_clip_fraction: str = "band"
    adv_clip_max: float | None = 5.0
    ratio_std_ddof: int = 0
    kl_coef: float = 0.0
    kl_form: str = "exact"
    cps_log_prob: str = "squared_error"
    micro_batch_size: int | None = None
    inner_epochs: int = 1
    logprob_gap_alarm: float = 1e-3
    on_logprob_gap: str = "warn"


RULES = flowgrpo.rules_as(NAME, flowgrpo.COMMON_RULES).merged(
    KeyRules(
        positive=frozenset({f"{NAME}.timestep_fraction", f"{NAME}.advantage_eps"}),
        unit_interval=frozenset({f"{NAME}.timestep_fraction"}),
        choices={
            f"{NAME}.sde_type": ("dance", "sde", "cps"),
            f"{NAME}.gspo_clip_fraction": flowgrpo.GSPO_CLIP_FRACTIONS,
        },
    )
)
step_objective = flowgrpo.step_objective


def advantages(settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's advantages of the global batch with this section's std epsilon (``advantage_eps``)."""
    from runtime.rl.algorithms.objectives import group_advantages

    return group_advantages(
        rewards, group_ids, settings.advantage, eps=settings.advantage_eps, ddof=settings.advantage_std_ddof
    )


def check(config: RLConfig) -> None:
    """What the section's types and ranges do not say (called by ``parse_rl_config``)."""
    errors = ConfigErrors()
    s: Settings = config.algo
    if s.group_size < 2:
        errors.add(f"{NAME}.group_size: at least 2 (a group of one has advantage 0), found {s.group_size}")
    if s.ignore_last and config.sampling.num_inference_steps < 2:
        errors.add(f"{NAME}.ignore_last: a 1-step schedule has nothing else to train; set it to false")
    if s.advantage_std_ddof not in (0, 1):
        errors.add(f"{NAME}.advantage_std_ddof: 1 (torch.std) or 0 (np.std), found {s.advantage_std_ddof!r}")
    errors.add(*flowgrpo.metric_problems(NAME, s))
    if s.sde_type == "cps" and s.noise_level > 1:
        errors.add(f"{NAME}.noise_level: CPS takes a noise level in [0, 1], found {s.noise_level}")
    if s.kl_coef > 0 and config.reference == "lora_disabled" and config.lora.rank is None:
        errors.add(
            "reference: lora_disabled needs a LoRA run (lora.rank); full fine-tuning takes reference: frozen_copy"
        )
    errors.raise_if_any()


def window(settings: Settings, num_steps: int) -> tuple[int, tuple[int, int]]:
    """Every step is stochastic: one window over the whole schedule."""
    return num_steps, (0, 0)


def trained_count(settings: Settings, num_steps: int) -> int:
    """``K``: the steps each sample trains on."""
    eligible = num_steps - 1 if settings.ignore_last else num_steps
    return max(1, int(settings.timestep_fraction * eligible))


def _generator(tag: str, seed: int, step: int, index: int) -> torch.Generator:
    import torch

    digest = hashlib.sha256(f"patchgen.rl.dancegrpo.{tag}:{seed}:{step}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def train_positions(settings: Settings, num_steps: int, seed: int, step: int, first: int, count: int) -> torch.Tensor:
    """``[count, K]`` long: the steps global samples ``first .. first + count - 1`` train on (sorted)."""
    import torch

    eligible = num_steps - 1 if settings.ignore_last else num_steps
    k = trained_count(settings, num_steps)
    rows = [
        torch.randperm(eligible, generator=_generator("steps", seed, step, q))[:k].sort().values
        for q in range(first, first + count)
    ]
    return torch.stack(rows)


def initial_noise(
    settings: Settings, seed: int, step: int, first: int, count: int, latent_shape: Sequence[int]
) -> torch.Tensor | None:
    """``[count, *latent_shape]``: one noise per prompt group (global sample ``q`` is in group
    ``q // group_size``), or None (each sample draws its own) without ``init_same_noise``."""
    import torch

    if not settings.init_same_noise:
        return None
    g = settings.group_size
    groups = {q // g: None for q in range(first, first + count)}
    for group in groups:
        groups[group] = torch.randn(tuple(latent_shape), generator=_generator("noise", seed, step, group))
    return torch.stack([groups[q // g] for q in range(first, first + count)])


def conventions(settings: Settings) -> str:
    """The conventions in use, named for the log: the KL's label differs from Flow-GRPO's (module docstring)."""
    k = f"{settings.timestep_fraction:g} of the steps{' but the last' if settings.ignore_last else ''}"
    noise = "shared initial noise per group" if settings.init_same_noise else "own initial noise per sample"
    ddof = {1: "ddof=1 (verl-omni)", 0: "ddof=0"}[settings.advantage_std_ddof]
    eps = {1e-4: " (verl-omni)", 1e-8: " (DanceGRPO authors)"}.get(settings.advantage_eps, "")
    kl = {
        "exact": "exact Gaussian KL (verl-omni's dance_grpo: its std_dev_t carries sqrt(-dt))",
        "scaled": "scaled = exact x -dt (Flow-GRPO's form; no DanceGRPO peer)",
    }[settings.kl_form]
    parts = [f"advantage {settings.advantage} std {ddof} eps {settings.advantage_eps:g}{eps}", f"KL {kl}"]
    if settings.sde_type == "cps":
        form = {"squared_error": "-mean((x-mu)^2) (verl-omni)", "gaussian": "full Gaussian"}[settings.cps_log_prob]
        parts.append(f"CPS log-prob {form}")
    parts += [
        f"SDE {settings.sde_type} eta {settings.noise_level:g}",
        f"trains {k}",
        noise,
        "the model's own schedule",
    ]
    if settings.adv_clip_max is None:
        parts.append("advantages unclamped (verl's gspo)")
    return ", ".join(parts + flowgrpo.metric_conventions(settings))


class DanceGRPO(flowgrpo.FlowGRPO):
    """Every step stochastic, a seeded subset of them trained per sample, one initial noise per group."""

    name = NAME
    Settings = Settings
    rules = RULES
    window_keys = ()  # the window is the whole schedule

    def check(self, config: RLConfig) -> None:
        check(config)

    def advantages(self, settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return advantages(settings, rewards, group_ids)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def window(self, settings: Settings, num_steps: int, step: int) -> tuple[int, tuple[int, int]]:
        return window(settings, num_steps)

    def initial_noise(
        self, settings: Settings, seed: int, step: int, first: int, count: int, latent_shape: Sequence[int]
    ) -> torch.Tensor | None:
        return initial_noise(settings, seed, step, first, count, latent_shape)

    def train_positions(
        self, settings: Settings, window_size: int, seed: int, step: int, first: int, count: int
    ) -> torch.Tensor | None:
        return train_positions(settings, window_size, seed, step, first, count)


ALGORITHM = DanceGRPO()
