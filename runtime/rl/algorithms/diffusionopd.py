"""DiffusionOPD, on-policy distillation (verl-omni's name: ``docs/algo/diffusion_opd.md``), as an algorithm of
``runtime.rl``: the student (the trained policy, LoRA or full) rolls out Flow-GRPO's SDE trajectories, and a frozen
teacher replays the student's window steps on the student's own schedule and supervises them. Everything but the
per-step objective and the teacher is Flow-GRPO's (``runtime/rl/algorithms/flowgrpo.py``).

Why on-policy: the teacher advises on the states the student actually visits (no train/inference state mismatch, as
distilling on the teacher's own samples has), densely at every trained step instead of through one outcome reward.

The teacher is the loop's frozen reference with other weights (``Algorithm.teacher_path``): ``teacher_model_path``,
a pipeline directory of the policy's model type (its ``transformer/``: verl-omni's
``distillation.teacher_models.teacher_model.model_path``; LoRA weights merged first), or null: the policy's starting
weights as the top-level ``reference`` holds them (``lora_disabled``, ``frozen_copy``). The student's adapter takes
the step, so the teacher always replays on the student's noise grid.

Objective of one window step (``B`` samples of the micro-batch, ``D`` elements of a latent, the share scaling of
Flow-GRPO's module docstring applied by the loop)::

    distill_kl:     L_d = mean_b( sum_d (mu_s - mu_t)^2 / D / (2 sigma_b^2) )
    distill_fm_mse: L_d = mean_b( sum_d (v_s - v_t)^2 / D )
    loss_mode distill:   L = distill_loss_coef * L_d     (distill_loss_coef_scope: with_reward: L = L_d)
    loss_mode flow_grpo: L = clipped Flow-GRPO policy loss + distill_loss_coef * L_d

``distill_kl``: both steps are Gaussians of the same std ``s = std_dev_t * sqrt_dt`` (the schedule fixes it), so
``KL(N(mu_s, s^2) || N(mu_t, s^2)) = ||mu_s - mu_t||^2 / (2 s^2)``, averaged over the latent's elements like the
reference KL (``objectives.kl_to_reference``, ``kl_form``): ``scaled`` takes ``sigma = std_dev_t`` (verl-omni's
``distill_kl``: the exact KL times ``-dt``, the default), ``exact`` takes ``sigma = s``. ``distill_fm_mse``: the
student's and the teacher's predicted velocities at the same rollout latent ``x_t`` (verl-omni's
``distill_fm_mse``, which verl-omni's policy-gradient path rejects for want of a producer; here the loop computes
both velocities and takes the student's step from the same forward). Gradients flow through the student only.

``loss_mode: flow_grpo`` adds the term to Flow-GRPO's reward objective, verl-omni's ``use_distill_loss: true`` beside
``diffusion_loss.loss_mode: flow_grpo``; ``distill`` (the default) is verl-omni's pure distillation (``loss_mode:
distill_kl``): the rewards are scored and logged, never learned from (the advantages are 0). A KL to a reference
beside the teacher (verl-omni's third model state) is not built: ``kl_coef`` stays 0; with ``teacher_model_path``
null the teacher is that reference, and ``loss_mode: flow_grpo`` with ``distill_kl`` is Flow-GRPO's KL term.

Config: every ``flowgrpo:`` key (same meaning; ``kl_form`` picks ``distill_kl``'s sigma) under ``diffusionopd:``,
plus::

    diffusionopd:
      loss_mode: distill             # distill (the teacher alone) | flow_grpo (reward objective + the term)
      distill_loss_mode: distill_kl  # distill_kl (step Gaussians' KL) | distill_fm_mse (velocity MSE)
      distill_loss_coef: 1.0         # the term's weight
      distill_loss_coef_scope: always  # always (the coef scales pure distillation too) | with_reward (verl-omni's:
                                     # only beside the reward objective; pure distillation takes L_d alone)
      teacher_model_path: null       # a pipeline directory of the same model type; null: the starting weights
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigError, ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms import flowgrpo
from runtime.rl.algorithms.base import Gaussian, ReferenceTerms

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = [
    "ALGORITHM",
    "DiffusionOPD",
    "RULES",
    "Settings",
    "advantages",
    "check",
    "conventions",
    "distill_fm_mse",
    "distill_kl",
    "step_objective",
]

NAME = "diffusionopd"
LOSS_MODES = ("distill", "flow_grpo")  # the first is verl-omni's pure distillation (the default)
DISTILL_LOSS_MODES = ("distill_kl", "distill_fm_mse")  # verl-omni's names; the first its default
# where distill_loss_coef applies: in both loss modes (ours, the default), or only beside the reward objective
# (verl-omni's: its pure distillation, loss_mode=distill_kl, adds the term without the coefficient)
COEF_SCOPES = ("always", "with_reward")


@dataclass(frozen=True)
class Settings(flowgrpo.Settings):
    loss_mode: str = "distill"
    distill_loss_mode: str = "distill_kl"
    distill_loss_coef: float = 1.0
    distill_loss_coef_scope: str = "always"
    teacher_model_path: str | None = None


RULES = flowgrpo.rules_as(NAME).merged(
    KeyRules(
        positive=frozenset({f"{NAME}.distill_loss_coef"}),
        choices={
            f"{NAME}.loss_mode": LOSS_MODES,
            f"{NAME}.distill_loss_mode": DISTILL_LOSS_MODES,
            f"{NAME}.distill_loss_coef_scope": COEF_SCOPES,
        },
    )
)
window = flowgrpo.window


def check(config: RLConfig) -> None:
    """Flow-GRPO's checks under this section's name (pure distillation takes groups of one), and the teacher."""
    errors = ConfigErrors()
    s: Settings = config.algo
    try:
        flowgrpo.check_as(NAME, config)
    except ConfigError as exc:  # a group of one has no advantage: only the reward objective needs groups
        errors.add(*(m for m in exc.messages if s.loss_mode == "flow_grpo" or not m.startswith(f"{NAME}.group_size")))
    if s.kl_coef > 0:
        errors.add(
            f"{NAME}.kl_coef: a KL to a reference beside the teacher needs a second frozen model, which this run "
            "does not build; with teacher_model_path null the teacher is the reference (distill_loss_coef weighs it)"
        )
    if s.teacher_model_path is None:
        if s.loss_mode == "distill":
            errors.add(
                f"{NAME}.teacher_model_path: null makes the teacher the policy's starting weights, so pure "
                "distillation has nothing to learn (term and gradient 0); give a teacher pipeline directory, or "
                "loss_mode: flow_grpo (the term then holds the policy near its start)"
            )
        elif config.reference == "lora_disabled" and config.lora.rank is None:
            errors.add(
                "reference: lora_disabled needs a LoRA run (lora.rank); full fine-tuning with teacher_model_path "
                "null takes reference: frozen_copy"
            )
    elif not Path(s.teacher_model_path).is_dir():
        errors.add(f"{NAME}.teacher_model_path: {s.teacher_model_path}: no such directory")
    else:
        errors.add(*_scheduler_mismatch(config.model.path, s.teacher_model_path))
    if s.policy_loss_mode != "vanilla":
        errors.add(
            f"{NAME}.policy_loss_mode: {s.policy_loss_mode!r} is a form of the clipped ratio, not offered beside the "
            "distillation term (its objective takes the per-step ratio); remove the key or use algorithm: flowgrpo"
        )
    errors.raise_if_any()


def _scheduler_mismatch(student: str, teacher: str) -> list[str]:
    """The teacher replays the student's steps on the student's noise grid: a teacher pipeline whose scheduler
    config says otherwise (another shift, say) is refused, as verl-omni refuses it (its keys but ``_``-private ones
    compared; a directory without ``scheduler/``, a non-diffusers checkpoint, has nothing to compare)."""
    import json

    configs = []
    for root in (student, teacher):
        path = Path(root) / "scheduler" / "scheduler_config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        configs.append({k: v for k, v in raw.items() if not k.startswith("_")} if isinstance(raw, dict) else raw)
    if configs[0] == configs[1]:
        return []
    keys = sorted(k for k in set(configs[0]) | set(configs[1]) if configs[0].get(k) != configs[1].get(k))
    return [
        f"{NAME}.teacher_model_path: {teacher}: its scheduler config differs from model.path's in {', '.join(keys)}; "
        "the teacher replays the student's steps on the student's schedule (use a teacher of the same scheduler)"
    ]


def conventions(settings: Settings) -> str:
    """The conventions in use, named for the log (docs/flowgrpo.md, "Conventions")."""
    sigma = {"scaled": "sigma = std_dev_t (verl-omni's distill_kl)", "exact": "sigma = std_dev_t x sqrt_dt (exact)"}
    form = {
        "distill_kl": f"distill_kl mean((mu_s - mu_t)^2) / (2 sigma^2), {sigma[settings.kl_form]}",
        "distill_fm_mse": "distill_fm_mse mean((v_s - v_t)^2) (verl-omni's)",
    }[settings.distill_loss_mode]
    mode = {
        "distill": "loss_mode distill: the teacher alone, rewards logged only (verl-omni's loss_mode=distill_kl)",
        "flow_grpo": "loss_mode flow_grpo: reward objective + the term (verl-omni's use_distill_loss)",
    }[settings.loss_mode]
    teacher = settings.teacher_model_path or "the starting weights (reference)"
    coef = f"coef {settings.distill_loss_coef:g}"
    if settings.distill_loss_coef_scope == "with_reward":
        coef += " beside the reward objective only (verl-omni's)"
    parts = [f"DiffusionOPD (verl-omni's): {form}, {coef}", mode, f"teacher {teacher}"]
    if settings.loss_mode == "flow_grpo":
        parts.append(flowgrpo.conventions(settings))
    else:  # the ratio statistics are still logged
        parts += flowgrpo.metric_conventions(settings)
    return ", ".join(parts)


def advantages(settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's advantages for ``loss_mode: flow_grpo``; 0 for pure distillation (the rewards are monitored)."""
    import torch

    if settings.loss_mode == "distill":
        return torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)
    return flowgrpo.advantages(settings, rewards, group_ids)


def distill_kl(
    mean: torch.Tensor,
    teacher_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    form: str = "scaled",
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch-mean KL of the student's step Gaussian to the teacher's (module docstring), each sample's times
    ``weights`` when given."""
    from runtime.rl.algorithms.objectives import kl_to_reference

    return kl_to_reference(mean, teacher_mean, std_dev_t, sqrt_dt, form, weights)


def distill_fm_mse(v: torch.Tensor, teacher_v: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The mean squared difference of the student's and the teacher's velocities (the teacher's is constant); each
    sample's elements times its weight when ``weights`` (``[B]``) is given: ``mean_b(w_b mean_d(...))``."""
    sq = (v - teacher_v.detach()) ** 2
    if weights is not None:
        sq = sq * weights.detach().to(device=sq.device, dtype=sq.dtype).reshape(-1, *([1] * (sq.ndim - 1)))
    return sq.mean()


def step_objective(
    settings: Settings,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    kl_terms: Gaussian,
    weights: torch.Tensor | None = None,
    kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one window step of a micro-batch (before the share scaling) and its statistics (detached).

    ``kl_terms``: ``(mean, teacher_mean, std_dev_t, sqrt_dt)`` for ``distill_kl``, ``(v, teacher_v, ...)`` for
    ``distill_fm_mse``; ``weights``: the reward objective's per-sample weights, ``kl_weights`` the distillation
    term's (``Algorithm.step_objective``)."""
    import torch

    if settings.distill_loss_mode == "distill_kl":
        term = distill_kl(*kl_terms, settings.kl_form, kl_weights)
    else:
        term = distill_fm_mse(kl_terms[0], kl_terms[1], kl_weights)
    if settings.loss_mode == "flow_grpo":  # Flow-GRPO's clipped objective (its own KL is off: kl_coef 0)
        loss, stats = flowgrpo.step_objective(settings, log_prob, old_log_prob, advantage, None, weights=weights)
        loss = loss + settings.distill_loss_coef * term
    else:  # the distillation term is the whole objective; the ratio statistics still say how far the step moved
        from runtime.rl.algorithms.objectives import ratio_stats

        loss = term if settings.distill_loss_coef_scope == "with_reward" else settings.distill_loss_coef * term
        ratio = torch.exp(log_prob.detach() - old_log_prob.detach())
        stats = {"policy_loss": loss.detach(), **ratio_stats(ratio, settings.clip_range, settings.ratio_std_ddof)}
    stats[f"{settings.distill_loss_mode}_loss"] = term.detach()  # verl-omni's actor/distill_kl_loss (_fm_mse_loss)
    return loss, stats


class DiffusionOPD(flowgrpo.FlowGRPO):
    """Flow-GRPO's sampling; the step objective reads the teacher (the frozen reference, another checkpoint's
    weights when ``teacher_model_path`` is set) through the loop's ``kl_terms``."""

    name = NAME
    Settings = Settings
    rules = RULES

    def check(self, config: RLConfig) -> None:
        check(config)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def needs_reference(self, settings: Settings) -> bool:
        return True  # the teacher

    def teacher_path(self, settings: Settings) -> str | None:
        return settings.teacher_model_path

    def reference_terms(self, settings: Settings) -> ReferenceTerms:
        return "velocity" if settings.distill_loss_mode == "distill_fm_mse" else "mean"

    def advantages(self, settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return advantages(settings, rewards, group_ids)

    def step_objective(
        self,
        settings: Settings,
        log_prob: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantage: torch.Tensor,
        kl_terms: Gaussian | None,
        gaussian: Gaussian | None = None,
        seq_log_ratio: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        kl_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert kl_terms is not None, "needs_reference: the loop passes the teacher's terms"
        return step_objective(settings, log_prob, old_log_prob, advantage, kl_terms, weights, kl_weights)


ALGORITHM = DiffusionOPD()
