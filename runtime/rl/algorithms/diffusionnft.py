"""DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117): online RL on the forward (noising) process. The rollout may use
any sampler; only its clean samples ``x0`` and their rewards are kept: no trajectory, no SDE log-prob.

Optimality probability. The raw rewards of a prompt's group become ``r in [0, 1]``::

    r = 1/2 + 1/2 * clip((R - mean_group(R)) / Z_c, -1, 1)
    Z_c = reward_norm                                    reward_std: none
    Z_c = reward_norm * (std(R of the batch) + eps)      reward_std: global
    Z_c = reward_norm * (std(R of c's group) + eps)      reward_std: group

with the std's divisor ``n - reward_std_ddof`` (1: ``torch.std``, verl-omni's; 0: ``np.std``, the population std)
and ``eps = reward_std_eps``. (The paper leaves ``Z_c > 0`` to the user and names a reward std as the usual choice;
verl-omni divides by the global sample std + 1e-4 and clips at ``adv_clip_max``: ``reward_std: global``,
``reward_norm: <adv_clip_max>``, ``reward_std_eps: 1.0e-4``, ``reward_std_ddof: 1``. Without the epsilon (ours,
the default) a group whose rewards lie 1e-4 apart has ``|dR| / std`` of order 1 and saturates to ``r`` 0 or 1
where verl-omni's ``+ 1e-4`` damps it towards 1/2. A std of 0 (equal rewards, or a group or batch of one) has
``dR = 0``, whose ``r`` is 1/2.)

Adaptive weighting (``adaptive_weight: true``, verl-omni's ``diffusion_nft``; off by default, the paper's plain
velocity loss). verl-omni computes each implicit policy's error in x0 space, ``x0_hat - x0 = t (v - v_pm)``, and
divides its mean square by the detached mean absolute error (floored at ``adaptive_weight_min``), times
``adv_clip_max / beta`` (ours: ``reward_norm / beta``)::

    L_pm = t^2 ||v_pm - v||^2 / max(t mean|v_pm - v|, w_min) * reward_norm / beta

Against the default loss that is a per-sample factor ``t / mean|v_pm - v| * reward_norm / beta`` on each term: it
down-weighs low-noise draws (small ``t``) and samples the policy already fits, and scales the loss by
``reward_norm / beta``.

(``r = 1`` wholly positive, ``r = 0`` wholly negative, ``1/2`` neither).

Implicit policies. With the rollout's (old, frozen) velocity ``v_old`` and the trained one ``v_theta`` at the
same noisy input, the positive and negative policies are::

    v_plus  = (1 - beta) * v_old + beta * v_theta
    v_minus = (1 + beta) * v_old - beta * v_theta

Objective, on the forward process of a clean sample ``x0`` with noise ``eps`` at ``t ~ U(t_min, t_max)`` (rectified
flow: ``x_t = (1 - t) x0 + t eps``, target velocity ``v = eps - x0``)::

    L = E[ r * ||v_plus - v||^2 + (1 - r) * ||v_minus - v||^2 ]

``||.||^2`` the per-element mean over the sample. The gradient in ``v_theta`` is
``2 beta [r (v_plus - v) - (1 - r) (v_minus - v)]``: towards the positive data, away from the negative.

Config::

    diffusionnft:
      group_size: 4
      beta: 1.0                  # the implicit policies' step (the paper's beta)
      reward_norm: 1.0           # Z: the reward difference (in reward stds with reward_std) that makes r 0 or 1
      reward_std: none           # none | global | group: Z_c in units of the batch's or the group's reward std
      reward_std_ddof: 1         # the std's divisor n - ddof: 1 (torch.std, verl-omni) | 0 (np.std, population)
      reward_std_eps: 0.0        # added to the std: 0 (ours) | 1.0e-4 (verl-omni)
      adaptive_weight: false     # true: verl-omni's x0-space adaptive loss weighting (above)
      adaptive_weight_min: 1.0e-5  # its weight's floor (verl-omni's adaptive_weight_min)
      t_min: 0.0                 # the forward-process times drawn uniformly from [t_min, t_max]
      t_max: 1.0
      timesteps_per_sample: 1    # forward-process draws per clean sample and inner epoch
      micro_batch_size: null
      inner_epochs: 1

The loop (``runtime/rl/loop.py``) rolls out with the ODE (one window step at noise 0, never trained), reads
``trains_on = "clean_samples"`` and trains on the clean samples: per sample and draw ``j`` one ``(t, eps)``
(``runtime/rl/sampling/forward.py``) from a generator seeded by ``(model.seed, iteration, j, global sample)``
(resume and any layout draw alike); ``v_old`` is the policy's velocity on the first inner epoch (before any update
of the iteration). ``advantages`` is ``r`` (the ``advantage_*`` metrics report it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms.base import Algorithm

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = [
    "ALGORITHM",
    "DiffusionNFT",
    "RULES",
    "Settings",
    "advantages",
    "check",
    "conventions",
    "objective",
    "optimality",
    "window",
]

NAME = "diffusionnft"


@dataclass(frozen=True)
class Settings:
    group_size: int = 4
    beta: float = 1.0
    reward_norm: float = 1.0
    reward_std: str = "none"
    reward_std_ddof: int = 1
    reward_std_eps: float = 0.0
    adaptive_weight: bool = False
    adaptive_weight_min: float = 1e-5
    t_min: float = 0.0
    t_max: float = 1.0
    timesteps_per_sample: int = 1
    micro_batch_size: int | None = None
    inner_epochs: int = 1
    # fixed, not config keys: the rollout is the ODE sampler, there is no SDE and no reference
    noise_level = 0.0
    sde_type = "sde"
    cps_log_prob = "squared_error"
    kl_coef = 0.0


RULES = KeyRules(
    positive=frozenset(
        f"{NAME}.{k}"
        for k in (
            "group_size",
            "beta",
            "reward_norm",
            "timesteps_per_sample",
            "micro_batch_size",
            "inner_epochs",
            "adaptive_weight_min",
        )
    ),
    unit_interval=frozenset({f"{NAME}.t_min", f"{NAME}.t_max"}),
    non_negative=frozenset({f"{NAME}.reward_std_eps"}),
    choices={f"{NAME}.reward_std": ("none", "global", "group")},
)


def check(config: RLConfig) -> None:
    """What the section's types and ranges do not say."""
    errors = ConfigErrors()
    s: Settings = config.algo
    if s.group_size < 2:
        errors.add(f"{NAME}.group_size: at least 2 (a group of one has no relative reward), found {s.group_size}")
    if not s.t_min < s.t_max:
        errors.add(f"{NAME}.t_max: expected t_min < t_max, found t_min={s.t_min}, t_max={s.t_max}")
    if s.reward_std_ddof not in (0, 1):
        errors.add(f"{NAME}.reward_std_ddof: 1 (torch.std, verl-omni) or 0 (np.std), found {s.reward_std_ddof!r}")
    errors.raise_if_any()


def conventions(settings: Settings) -> str:
    weighting = (
        f", x0-space adaptive weighting x reward_norm / beta (verl-omni's, floor {settings.adaptive_weight_min:g})"
        if settings.adaptive_weight
        else ", velocity loss unweighted (the paper's)"
    )
    return (
        f"forward-process NFT, beta {settings.beta:g}, r = 1/2 + 1/2 clip(dR / {_z(settings)}, -1, 1), "
        f"t ~ U[{settings.t_min:g}, {settings.t_max:g}]{weighting}"
    )


def _z(settings: Settings) -> str:
    if settings.reward_std == "none":
        return f"{settings.reward_norm:g}"
    ddof = {1: "ddof=1 (verl-omni)", 0: "ddof=0 (population)"}[settings.reward_std_ddof]
    eps = f" + {settings.reward_std_eps:g}" + (" (verl-omni)" if settings.reward_std_eps == 1e-4 else "")
    return f"{settings.reward_norm:g} x ({settings.reward_std} std {ddof}{eps if settings.reward_std_eps else ''})"


def optimality(settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``r`` in ``[0, 1]`` of each sample of the GLOBAL batch: its reward against its group's mean, over ``Z_c``
    (module docstring). Finite for a group or batch of one: its centred reward is 0, its ``r`` 1/2."""
    import torch

    groups, inverse = torch.unique(group_ids, return_inverse=True)
    sums = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    counts = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    centred = rewards - (sums / counts)[inverse]
    ddof, eps = settings.reward_std_ddof, settings.reward_std_eps
    z = torch.full_like(rewards, settings.reward_norm)
    if settings.reward_std == "global":
        spread = (rewards - rewards.mean()).square().sum() / max(rewards.numel() - ddof, 1)
        z = z * (spread.sqrt() + eps)
    elif settings.reward_std == "group":
        squares = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, centred.square())
        z = z * ((squares / (counts - ddof).clamp_min(1)).sqrt()[inverse] + eps)
    # a std of 0: every reward equal (or one sample), centred 0, r = 1/2 (not 0/0)
    return 0.5 + 0.5 * (centred / z.clamp_min(torch.finfo(z.dtype).tiny)).clamp(-1.0, 1.0)


def window(settings: Settings, num_steps: int) -> tuple[int, tuple[int, int]]:
    """The rollout's one window step (at noise 0: an ODE step like the others; not trained)."""
    return 1, (0, num_steps - 1)


def advantages(settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``r`` of the global batch (what the loop passes to ``objective``)."""
    return optimality(settings, rewards, group_ids)


def objective(
    settings: Settings,
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    target: torch.Tensor,
    r: torch.Tensor,
    t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch mean of ``r ||v_plus - v||^2 + (1 - r) ||v_minus - v||^2`` and its statistics (detached); with
    ``adaptive_weight`` verl-omni's x0-space adaptive form (module docstring), which needs the times ``t`` ``[B]``."""
    beta = settings.beta
    old = v_old.detach()
    v_plus = (1 - beta) * old + beta * v_theta
    v_minus = (1 + beta) * old - beta * v_theta
    dims = tuple(range(1, v_theta.dim()))
    if settings.adaptive_weight:
        if t is None:
            raise ValueError("adaptive_weight: the objective needs the forward-process times t")
        tt = t.reshape(-1, *([1] * (v_theta.dim() - 1))).to(v_theta.dtype)

        def adaptive(v: torch.Tensor) -> torch.Tensor:  # x0_hat - x0 = t (v_target - v): x0-space error
            err = tt * (target - v)
            weight = err.detach().abs().mean(dim=dims).clamp_min(settings.adaptive_weight_min)
            return err.square().mean(dim=dims) / weight

        pos, neg = adaptive(v_plus), adaptive(v_minus)
        scale = settings.reward_norm / beta  # verl-omni's adv_clip_max / mix_beta
    else:
        pos = (v_plus - target).square().mean(dim=dims)
        neg = (v_minus - target).square().mean(dim=dims)
        scale = 1.0
    rr = r.to(pos.dtype)
    per_sample = rr * pos + (1 - rr) * neg
    loss = per_sample.mean() * scale
    stats = {
        "policy_loss": loss.detach(),
        "positive_loss": pos.detach().mean(),
        "negative_loss": neg.detach().mean(),
        "optimality_mean": rr.detach().mean(),
    }
    return loss, stats


class DiffusionNFT(Algorithm):
    """The forward process on the rollout's clean samples, weighted by each sample's optimality."""

    name = NAME
    Settings = Settings
    rules = RULES
    trains_on = "clean_samples"

    def check(self, config: RLConfig) -> None:
        check(config)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def needs_reference(self, settings: Settings) -> bool:
        return False

    def window(self, settings: Settings, num_steps: int, step: int) -> tuple[int, tuple[int, int]]:
        return window(settings, num_steps)

    def advantages(self, settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return advantages(settings, rewards, group_ids)

    def forward_objective(
        self,
        settings: Settings,
        v: torch.Tensor,
        v_old: torch.Tensor,
        target: torch.Tensor,
        weights: torch.Tensor,
        t: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return objective(settings, v, v_old, target, weights, t)


ALGORITHM = DiffusionNFT()
