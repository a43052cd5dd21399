"""Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908) for flow-matching models: offline preference pairs
(prompt, chosen image ``w``, rejected image ``l``), a frozen reference policy, no rollout.

Both images of a pair are noised with the same ``t`` and noise ``eps`` (rectified flow: ``x_t = (1 - t) x0 + t eps``,
target ``v = eps - x0``); ``e`` is the per-sample mean squared flow-matching error of a policy::

    e_w = ||v_theta(x_t^w) - v^w||^2,   e_w_ref = ||v_ref(x_t^w) - v^w||^2   (likewise for l)
    d = (e_w - e_w_ref) - (e_l - e_l_ref)
    L = -log sigmoid(-beta / 2 * d)                                       (batch mean)

``d < 0``: the policy improved on the chosen image more than on the rejected one, relative to the reference (the
implicit reward prefers ``w``); ``reward_accuracy`` is the share of pairs with ``d < 0``.

Config::

    dpo:
      beta: 5000.0               # the paper's beta (its SD1.5 / SDXL recipe)
      t_min: 0.0
      t_max: 1.0
      micro_batch_size: null

Not wired into ``runtime/rl/loop.py`` yet (not in ``ALGORITHMS``): the pair dataset (JSONL of prompt, chosen,
rejected) and the offline training step are left; ``objective`` is the loss they need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.train.config import ConfigError, KeyRules

if TYPE_CHECKING:
    import torch

__all__ = ["RULES", "Settings", "check", "conventions", "objective"]

NAME = "dpo"


@dataclass(frozen=True)
class Settings:
    beta: float = 5000.0
    t_min: float = 0.0
    t_max: float = 1.0
    micro_batch_size: int | None = None


RULES = KeyRules(
    positive=frozenset({f"{NAME}.beta", f"{NAME}.micro_batch_size"}),
    unit_interval=frozenset({f"{NAME}.t_min", f"{NAME}.t_max"}),
)


def check(config: Any) -> None:
    """What the section's types and ranges do not say."""
    s: Settings = config.algo
    if not s.t_min < s.t_max:
        raise ConfigError(f"{NAME}.t_max: expected t_min < t_max, found t_min={s.t_min}, t_max={s.t_max}")


def conventions(settings: Settings) -> str:
    return f"Diffusion-DPO on flow matching, beta {settings.beta:g}, t ~ U[{settings.t_min:g}, {settings.t_max:g}]"


def objective(
    settings: Settings,
    v_w: torch.Tensor,
    v_l: torch.Tensor,
    v_w_ref: torch.Tensor,
    v_l_ref: torch.Tensor,
    target_w: torch.Tensor,
    target_l: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch mean of ``-log sigmoid(-beta / 2 * d)`` and its statistics (detached); the reference is constant."""
    import torch.nn.functional as F

    dims = tuple(range(1, v_w.dim()))

    def err(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (v - target).square().mean(dim=dims)

    e_w, e_l = err(v_w, target_w), err(v_l, target_l)
    e_w_ref, e_l_ref = err(v_w_ref.detach(), target_w), err(v_l_ref.detach(), target_l)
    d = (e_w - e_w_ref) - (e_l - e_l_ref)
    loss = -F.logsigmoid(-0.5 * settings.beta * d).mean()
    stats = {
        "policy_loss": loss.detach(),
        "reward_accuracy": (d.detach() < 0).to(loss.dtype).mean(),
        "implicit_margin": (-0.5 * settings.beta * d.detach()).mean(),
        "error_chosen": e_w.detach().mean(),
        "error_rejected": e_l.detach().mean(),
    }
    return loss, stats
