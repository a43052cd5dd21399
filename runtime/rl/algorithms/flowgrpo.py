"""Flow-GRPO as an algorithm of ``runtime.rl``: its config section (``flowgrpo:``), its rollout-window choice and its
per-step objective. The shared loop (``runtime/rl/loop.py``) does the rest.

Config (every key with its default; the verl-omni and flow_grpo names are in docs/flowgrpo.md)::

    flowgrpo:
      group_size: 4              # samples per prompt (>= 2: a group of one has no advantage)
      window_size: 2             # SDE steps per sample (the others are Euler ODE steps), trained on
      window_range: null         # [first, last] window start (inclusive); null: [0, N - window_size]
      noise_level: 0.7           # the SDE's noise level a
      sde_type: sde              # sde (Flow-GRPO) | cps (coefficient-preserving: noise_level in [0, 1])
      cps_log_prob: squared_error  # CPS log-prob: squared_error (verl-omni) | gaussian
      advantage: global          # global (batch std: verl-omni's and flow_grpo's default) | group | none
      advantage_std_ddof: 1      # 1: torch.std (verl-omni) | 0: np.std (flow_grpo)
      clip_range: 1.0e-4         # PPO ratio clip
      policy_loss_mode: vanilla  # vanilla: a ratio per step | gspo: one per sample, the geometric mean of its
                                 # trained steps' ratios, clipped per sample (GSPO; verl's policy_loss.loss_mode)
      gspo_clip_fraction: band   # gspo's clip_fraction: band (ratio outside [1 - clip, 1 + clip], as vanilla's) |
                                 # verl (the share where the clip binds, clip_fraction_low 0: verl's gspo)
      adv_clip_max: 5.0          # advantages clamped to [-adv_clip_max, adv_clip_max]; null: unclamped (verl's gspo)
      ratio_std_ddof: 0          # the ratio_std metric's divisor n - ddof: 0 (population) | 1 (verl-omni's torch.std)
      kl_coef: 0.0               # > 0: KL to the reference (the top-level `reference` key)
      kl_form: scaled            # scaled: exact KL x -dt (verl-omni, flow_grpo) | exact
      micro_batch_size: null     # samples per forward/backward; null: all of the replica's samples at once (the
                                 # rollout's layout: recomputed log-probs equal the rollout's bitwise)
      inner_epochs: 1            # optimizer steps per iteration on the same rollout (later ones shuffle)
      logprob_gap_alarm: 1.0e-3  # max |logp_train - logp_rollout| on the first inner step above this: an alarm
      on_logprob_gap: warn       # warn (print the alarm, count it) | stop (exit 2)

Window choice: each sample's window start is drawn from its own seeded generator, uniform over ``window_range``
(the first draw of the sample's generator, before its initial noise: ``runtime/rl/sampling/rollout.py``), so a
sample's trajectory does not depend on its batch, rank or micro-batch.

Objective of one window step ``j`` of a micro-batch of ``n`` of the replica's ``B`` samples (``W`` window steps,
``D`` data-parallel replicas): ``(policy_loss + kl_coef * kl) * n / (B * W * D)``, so the summed gradients over
micro-batches, steps and replicas are the gradient of the mean over the global batch (SP ranks compute the same
share: the DiT's SP gradients add up to the single-process ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigError, ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms.base import Algorithm, Gaussian

if TYPE_CHECKING:  # the config part (Settings, RULES, check) is read before torch is imported (runtime.rl --help)
    import torch

    from runtime.rl.config import RLConfig

__all__ = ["ALGORITHM", "FlowGRPO", "RULES", "Settings", "check", "conventions", "step_objective", "window"]


@dataclass(frozen=True)
class Settings:
    group_size: int = 4
    window_size: int = 2
    window_range: list | None = None
    noise_level: float = 0.7
    sde_type: str = "sde"
    cps_log_prob: str = "squared_error"
    advantage: str = "global"
    advantage_std_ddof: int = 1
    clip_range: float = 1e-4
    policy_loss_mode: str = "vanilla"
    gspo_clip_fraction: str = "band"
    adv_clip_max: float | None = 5.0
    ratio_std_ddof: int = 0
    kl_coef: float = 0.0
    kl_form: str = "scaled"
    micro_batch_size: int | None = None
    inner_epochs: int = 1
    logprob_gap_alarm: float = 1e-3
    on_logprob_gap: str = "warn"


# verl's policy_loss.loss_mode names: the per-step ratio (the default), GSPO's per-sample ratio (objectives.py)
POLICY_LOSS_MODES = ("vanilla", "gspo")
# GSPO's clip fraction: the ratio outside the band (ours, the vanilla mode's), or where the clip binds (verl's gspo)
GSPO_CLIP_FRACTIONS = ("band", "verl")

# The rules of the keys every Flow-GRPO-style section shares (groups, noise, advantages, the clipped objective, the
# log-prob gap alarm): DanceGRPO's section is these (``rules_as``) plus its own, without the window keys.
COMMON_RULES = KeyRules(
    positive=frozenset(
        f"flowgrpo.{k}"
        for k in ("group_size", "clip_range", "adv_clip_max", "micro_batch_size", "inner_epochs", "logprob_gap_alarm")
    ),
    non_negative=frozenset({"flowgrpo.noise_level", "flowgrpo.kl_coef"}),
    choices={
        "flowgrpo.cps_log_prob": ("squared_error", "gaussian"),
        "flowgrpo.advantage": ("global", "group", "none"),
        "flowgrpo.policy_loss_mode": POLICY_LOSS_MODES,
        "flowgrpo.gspo_clip_fraction": GSPO_CLIP_FRACTIONS,
        "flowgrpo.kl_form": ("scaled", "exact"),
        "flowgrpo.on_logprob_gap": ("warn", "stop"),
    },
)
RULES = COMMON_RULES.merged(
    KeyRules(positive=frozenset({"flowgrpo.window_size"}), choices={"flowgrpo.sde_type": ("sde", "cps")})
)


def window(settings: Settings, num_steps: int) -> tuple[int, tuple[int, int]]:
    """(window size, inclusive range of window starts) over a schedule of ``num_steps`` steps."""
    if settings.window_range is None:
        return settings.window_size, (0, num_steps - settings.window_size)
    lo, hi = settings.window_range
    return settings.window_size, (int(lo), int(hi))


def rules_as(section: str, rules: KeyRules = RULES) -> KeyRules:
    """Flow-GRPO's key rules (or ``COMMON_RULES``) under another algorithm's section name (GRPO-Guard and MixGRPO
    extend its settings, DanceGRPO shares the common ones)."""

    def rename(key: str) -> str:
        return f"{section}.{key.split('.', 1)[1]}"

    return KeyRules(
        frozenset(map(rename, rules.positive)),
        frozenset(map(rename, rules.non_negative)),
        frozenset(map(rename, rules.unit_interval)),
        {rename(k): v for k, v in rules.choices.items()},
    )


def check_as(section: str, config: RLConfig) -> None:
    """Flow-GRPO's checks, each message naming ``section`` (the extending algorithm's config section)."""
    try:
        check(config)
    except ConfigError as exc:
        raise ConfigError(*(m.replace("flowgrpo.", f"{section}.") for m in exc.messages)) from None


def check(config: RLConfig) -> None:
    """What the section's types and ranges do not say (called by ``parse_rl_config``)."""
    errors = ConfigErrors()
    s: Settings = config.algo
    steps = config.sampling.num_inference_steps
    if s.group_size < 2:
        errors.add(f"flowgrpo.group_size: at least 2 (a group of one has advantage 0), found {s.group_size}")
    if s.window_size > steps:
        errors.add(f"flowgrpo.window_size: {s.window_size} SDE steps do not fit sampling.num_inference_steps={steps}")
    if s.window_range is not None and s.window_size <= steps:  # else the window_size error says it
        last = steps - s.window_size
        ok = (
            len(s.window_range) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in s.window_range)
            and 0 <= s.window_range[0] <= s.window_range[1] <= last
        )
        if not ok:
            errors.add(
                f"flowgrpo.window_range: expected [first, last] window starts with 0 <= first <= last <= {last} "
                f"(num_inference_steps - window_size), found {s.window_range!r}"
            )
    if s.advantage_std_ddof not in (0, 1):
        errors.add(
            f"flowgrpo.advantage_std_ddof: 1 (verl-omni's torch.std) or 0 (flow_grpo's np.std), found "
            f"{s.advantage_std_ddof!r}"
        )
    errors.add(*metric_problems("flowgrpo", s))
    if s.sde_type == "cps" and s.noise_level > 1:
        errors.add(f"flowgrpo.noise_level: CPS takes a noise level in [0, 1], found {s.noise_level}")
    if s.kl_coef > 0 and config.reference == "lora_disabled" and config.lora.rank is None:
        errors.add(
            "reference: lora_disabled needs a LoRA run (lora.rank); full fine-tuning takes reference: frozen_copy"
        )
    errors.raise_if_any()


def metric_problems(section: str, s: Settings) -> list[str]:
    """The metric conventions' keys (shared with DanceGRPO's section): ``ratio_std_ddof`` 0 or 1, and
    ``gspo_clip_fraction`` only where there is a GSPO clip fraction to define."""
    out = []
    if s.ratio_std_ddof not in (0, 1):
        out.append(
            f"{section}.ratio_std_ddof: 0 (the population std) or 1 (verl-omni's torch.std), found "
            f"{s.ratio_std_ddof!r}"
        )
    if s.gspo_clip_fraction != "band" and s.policy_loss_mode != "gspo":
        out.append(
            f"{section}.gspo_clip_fraction: only with policy_loss_mode: gspo (the vanilla clip fraction is "
            "verl-omni's already); remove the key"
        )
    return out


def metric_conventions(settings: Settings) -> list[str]:
    """The log's words for the metric conventions that differ from the defaults."""
    parts = []
    if settings.ratio_std_ddof == 1:
        parts.append("ratio_std ddof=1 (verl-omni's flow_grpo, grpo_guard)")
    if settings.gspo_clip_fraction == "verl":
        parts.append("clip fraction where the clip binds, low side 0 (verl's gspo)")
    return parts


def conventions(settings: Settings) -> str:
    """The conventions in use, named for the log (docs/flowgrpo.md, "Conventions")."""
    ddof = {1: "ddof=1 (verl-omni)", 0: "ddof=0 (flow_grpo)"}[settings.advantage_std_ddof]
    kl = {"scaled": "scaled = exact x -dt (verl-omni, flow_grpo)", "exact": "exact Gaussian KL"}[settings.kl_form]
    parts = [f"advantage {settings.advantage} std {ddof}", f"KL {kl}"]
    if settings.sde_type == "cps":
        form = {"squared_error": "-mean((x-mu)^2) (verl-omni)", "gaussian": "full Gaussian"}[settings.cps_log_prob]
        parts.append(f"CPS log-prob {form}")
    if settings.policy_loss_mode == "gspo":
        parts.append("ratio per sample exp(mean of its trained steps' log r), clipped per sample (GSPO, verl's gspo)")
    if settings.adv_clip_max is None:
        parts.append("advantages unclamped (verl's gspo)")
    return ", ".join(parts + metric_conventions(settings))


def advantages(settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Advantages of the GLOBAL batch's rewards (every replica's samples: the global std needs them all)."""
    from runtime.rl.algorithms.objectives import group_advantages

    return group_advantages(rewards, group_ids, settings.advantage, ddof=settings.advantage_std_ddof)


def step_objective(
    settings: Settings,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    kl_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    seq_log_ratio: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one window step of a micro-batch (before the share scaling) and its statistics (detached).

    ``kl_terms``: ``(mean, ref_mean, std_dev_t, sqrt_dt)`` when ``kl_coef > 0``; ``seq_log_ratio``: each sample's
    mean log-ratio over its trained steps (``policy_loss_mode: gspo``); ``weights`` / ``kl_weights``: per-sample
    weights of the policy and the KL term (``Algorithm.step_objective``)."""
    import torch

    from runtime.rl.algorithms.objectives import (
        binding_clip_fraction,
        kl_to_reference,
        policy_loss,
        ratio_stats,
        sequence_policy_loss,
    )

    clip, adv_max = settings.clip_range, settings.adv_clip_max
    if settings.policy_loss_mode == "gspo":
        if seq_log_ratio is None:
            raise ValueError("policy_loss_mode gspo: the loop passes each sample's sequence log-ratio (seq_log_ratio)")
        loss, clip_fraction, approx_kl, ratio = sequence_policy_loss(
            log_prob, seq_log_ratio, advantage, clip, adv_max, weights
        )
        stats = {"seq_ratio_mean": ratio.mean()}
    else:
        loss, clip_fraction, approx_kl = policy_loss(log_prob, old_log_prob, advantage, clip, adv_max, weights)
        ratio, stats = torch.exp(log_prob.detach() - old_log_prob.detach()), {}
    stats |= {"policy_loss": loss.detach(), "clip_fraction": clip_fraction, "approx_kl": approx_kl}
    stats |= ratio_stats(ratio, clip, settings.ratio_std_ddof)
    if settings.policy_loss_mode == "gspo" and settings.gspo_clip_fraction == "verl":
        binding = binding_clip_fraction(ratio, advantage, clip, adv_max)
        stats |= {"clip_fraction": binding, "clip_fraction_high": binding}
        stats["clip_fraction_low"] = torch.zeros_like(binding)
    if kl_terms is not None:
        kl = kl_to_reference(*kl_terms, settings.kl_form, kl_weights)
        loss = loss + settings.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


class FlowGRPO(Algorithm):
    """Flow-GRPO through the loop's contract (``runtime/rl/algorithms/base.py``): a fixed-size window drawn per
    sample, group advantages, the clipped objective on every window step."""

    name = "flowgrpo"
    Settings = Settings
    rules = RULES
    window_keys = ("window_size", "window_range")

    def check(self, config: RLConfig) -> None:
        check(config)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def window(self, settings: Settings, num_steps: int, step: int) -> tuple[int, tuple[int, int]]:
        return window(settings, num_steps)

    def advantages(self, settings: Settings, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return advantages(settings, rewards, group_ids)

    def needs_sequence_ratio(self, settings: Settings) -> bool:
        return settings.policy_loss_mode == "gspo"

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
        return step_objective(
            settings, log_prob, old_log_prob, advantage, kl_terms, seq_log_ratio, weights, kl_weights
        )

    def gap_alarm(self, settings: Settings) -> float:
        return settings.logprob_gap_alarm


ALGORITHM = FlowGRPO()
