"""Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908) for flow-matching models: offline preference pairs
(prompt, chosen image or video ``w``, rejected ``l``), a frozen reference policy, no rollout and no reward.

Both images (videos) of a pair are noised with the same ``t`` and noise ``eps`` (rectified flow:
``x_t = (1 - t) x0 + t eps``, target ``v = eps - x0``); ``e`` is the per-sample mean squared flow-matching error of
a policy::

    e_w = ||v_theta(x_t^w) - v^w||^2,   e_w_ref = ||v_ref(x_t^w) - v^w||^2   (likewise for l)
    d = (e_w - e_w_ref) - (e_l - e_l_ref)
    L = -log sigmoid(-beta / 2 * d)                                       (batch mean)

(the paper's ``-log sigmoid(-beta T w(lambda_t) (...))`` with the noise-prediction error replaced by the velocity
error and the constant ``T w(lambda_t)`` folded into ``beta``; its ``1/2`` kept). ``d < 0``: the policy improved on
the chosen image more than on the rejected one, relative to the reference (the implicit reward prefers ``w``);
``implicit_reward_accuracy`` is the share of pairs with ``d < 0``, ``implicit_reward_margin`` the mean of
``-beta / 2 * d``.

Config (``data.pairs`` replaces ``data.prompts``; no ``rewards``; ``reference`` picks the frozen reference)::

    algorithm: dpo
    data: {pairs: pairs.jsonl, prompts_per_step: 2, seed: 0}   # pairs per replica per iteration (runtime/rl/pairs.py)
    reference: lora_disabled     # or frozen_copy (full fine-tuning needs frozen_copy)
    dpo:
      beta: 5000.0               # the paper's beta (its SD1.5 / SDXL recipe)
      t_min: 0.0                 # t ~ U[t_min, t_max], one draw per pair, shared by its two images
      t_max: 1.0
      micro_batch_size: null     # pairs per forward

Each iteration (``runtime/rl/offline.py``, the loop's path for ``data == "pairs"``): this replica's pairs from the
seeded sampler, their images (a video model: the first ``sampling.frames`` frames of their videos) encoded by the
model's VAE, ``(t, eps)`` per pair from a generator seeded by ``(model.seed, iteration, global pair)`` (SP ranks and a
resumed run draw alike), the policy's and the reference's velocities, one optimizer update with the job's guards.
Every flow-matching DiT of the job: image pairs for the image models (Flux, SD3, Qwen-Image), video pairs for the
video models (Wan, HunyuanVideo; ``runtime/rl/pairs.py`` refuses a video shorter than ``sampling.frames``); CogVideoX
is refused as for every algorithm (v-prediction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms.base import Algorithm

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = ["ALGORITHM", "DPO", "RULES", "Settings", "check", "conventions", "objective"]

NAME = "dpo"


@dataclass(frozen=True)
class Settings:
    beta: float = 5000.0
    t_min: float = 0.0
    t_max: float = 1.0
    micro_batch_size: int | None = None
    # fixed, not config keys: no rollout (the policy's sampler settings), one sample per pair, always a reference
    group_size = 1
    inner_epochs = 1
    noise_level = 0.0
    sde_type = "sde"
    cps_log_prob = "squared_error"
    kl_coef = 0.0


RULES = KeyRules(
    positive=frozenset({f"{NAME}.beta", f"{NAME}.micro_batch_size"}),
    unit_interval=frozenset({f"{NAME}.t_min", f"{NAME}.t_max"}),
)


def check(config: RLConfig) -> None:
    """What the section's types and ranges do not say, and the shared keys DPO reads differently: its data is
    ``data.pairs``, it has no reward, full fine-tuning needs a frozen copy as reference."""
    errors = ConfigErrors()
    s: Settings = config.algo
    if not s.t_min < s.t_max:
        errors.add(f"{NAME}.t_max: expected t_min < t_max, found t_min={s.t_min}, t_max={s.t_max}")
    data = config.data
    if data is not None and data.prompts is not None:
        errors.add(
            "data.prompts: dpo trains on offline preference pairs, not prompts; give data.pairs (a JSONL of "
            '{"prompt", "chosen", "rejected"}, docs/flowgrpo.md) instead'
        )
    elif data is not None and data.pairs is None:
        errors.add(
            'data.pairs: required key missing (a JSONL of {"prompt", "chosen", "rejected"} image or video pairs)'
        )
    if config.rewards:
        errors.add("rewards: dpo learns from preference pairs and scores nothing; remove rewards")
    if config.reward_ranks is not None:
        errors.add("reward_ranks: dpo scores nothing; remove reward_ranks")
    if config.reference == "lora_disabled" and config.lora.rank is None:
        errors.add(
            "reference: lora_disabled needs a LoRA run (lora.rank); full fine-tuning: set reference: frozen_copy"
        )
    if config.sampling is not None and config.sampling.true_cfg_scale != 1:
        errors.add("sampling.true_cfg_scale: dpo trains the conditional prediction; remove sampling.true_cfg_scale")
    if config.model is not None and config.model.architecture is not None:
        errors.add(f"model.architecture: dpo trains generated DiTs (model.type), not {config.model.architecture!r}")
    errors.raise_if_any()


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
        "implicit_reward_accuracy": (d.detach() < 0).to(loss.dtype).mean(),
        "implicit_reward_margin": (-0.5 * settings.beta * d.detach()).mean(),
        "error_chosen": e_w.detach().mean(),
        "error_rejected": e_l.detach().mean(),
        "error_chosen_ref": e_w_ref.mean(),
        "error_rejected_ref": e_l_ref.mean(),
    }
    return loss, stats


class DPO(Algorithm):
    """Offline: preference pairs instead of prompts, no rollout, no reward, always a reference."""

    name = NAME
    Settings = Settings
    rules = RULES
    data = "pairs"
    trains_on = "pairs"

    def check(self, config: RLConfig) -> None:
        check(config)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def needs_reference(self, settings: Settings) -> bool:
        return True

    def pair_objective(
        self,
        settings: Settings,
        v_w: torch.Tensor,
        v_l: torch.Tensor,
        v_w_ref: torch.Tensor,
        v_l_ref: torch.Tensor,
        target_w: torch.Tensor,
        target_l: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return objective(settings, v_w, v_l, v_w_ref, v_l_ref, target_w, target_l)


ALGORITHM = DPO()
