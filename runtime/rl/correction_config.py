"""The ``rollout_correction`` section: truncated importance sampling and rejection sampling of rollout steps whose
log-probs came from another engine than the trained policy (``runtime/rl/rollout_correction.py`` has the math).
Read before torch is imported (``runtime.rl --help``), so this module imports none.

Keys and meanings are verl's ``algorithm.rollout_correction`` (verl-omni uses verl's schema)::

    rollout_correction:
      rollout_is: null             # null (off) | token (one weight per trained SDE step) | sequence (one per sample:
                                   # the product of its trained steps' ratios)
      rollout_is_threshold: 2.0    # C of TIS: weight = min(pi_old / pi_rollout, C), C >= 1
      rollout_rs: null             # null (off) | token_k1 | token_k2 | token_k3 | seq_sum_k1 | seq_sum_k2 |
                                   # seq_sum_k3 | seq_mean_k1 | seq_mean_k2 | seq_mean_k3 | seq_max_k2 | seq_max_k3
      rollout_rs_threshold: null   # required with rollout_rs: *_k1 "lower_upper" (e.g. "0.5_2.0") or one upper
                                   # bound (lower = 1 / upper); k2 / k3 / max: one upper bound
      weighted_terms: all          # all (the policy term, the KL and the distillation term) | policy (verl-omni's:
                                   # the policy term alone; its KL and distillation losses are added unweighted)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "IS_LEVELS",
    "RS_OPTIONS",
    "RolloutCorrectionConfig",
    "WEIGHTED_TERMS",
    "correction_problems",
    "rs_bounds",
]

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
WEIGHTED_TERMS = ("all", "policy")  # the first is ours (the default), the second verl-omni's


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    weighted_terms: str = "all"

    @property
    def enabled(self) -> bool:
        """Whether the training side recomputes the old policy's log-probs and weights the rollout's steps."""
        return self.rollout_is is not None or self.rollout_rs is not None


def rs_bounds(option: str, spec: str | float) -> tuple[float | None, float]:
    """(lower, upper) of rejection option ``option``: a k1 band (lower defaults to 1 / upper) or a k2 / k3 upper
    bound (lower None). Raises ``ValueError`` with the key's one-line message."""
    text = str(spec).strip()
    if option.endswith("k1"):
        low_text, _, up_text = text.partition("_") if "_" in text else ("", "", text)
        try:
            upper = float(up_text)
            lower = float(low_text) if low_text else 1.0 / upper
        except (ValueError, ZeroDivisionError):
            raise ValueError(
                f"expected 'lower_upper' (e.g. '0.5_2.0') or one number for {option}, found {spec!r}"
            ) from None
        if not (0 < lower <= upper and math.isfinite(upper)):
            raise ValueError(f"expected 0 < lower <= upper for {option}, found {spec!r}") from None
        return lower, upper
    if "_" in text:
        raise ValueError(f"{option} takes one upper bound, not a band, found {spec!r}") from None
    try:
        upper = float(text)
    except ValueError:
        raise ValueError(f"expected one number for {option}, found {spec!r}") from None
    if not (0 < upper and math.isfinite(upper)):
        raise ValueError(f"expected a positive finite bound for {option}, found {spec!r}") from None
    return None, upper


def correction_problems(rc: RolloutCorrectionConfig, algorithm: str, trains_on: str) -> list[str]:
    """One line per problem of the section (the algorithm must train on the rollout's steps: only they have
    log-probs)."""
    out: list[str] = []
    if rc.rollout_is is not None and rc.rollout_is not in IS_LEVELS:
        out.append(f"rollout_correction.rollout_is: expected null, token or sequence, found {rc.rollout_is!r}")
    if not rc.rollout_is_threshold >= 1:  # C < 1 truncates even an on-policy step's weight 1 (and 1e-300 underflows)
        out.append(
            f"rollout_correction.rollout_is_threshold: expected a number >= 1 (C of min(ratio, C); verl's default "
            f"2.0), found {rc.rollout_is_threshold}"
        )
    if rc.rollout_rs is not None and rc.rollout_rs not in RS_OPTIONS:
        out.append(
            f"rollout_correction.rollout_rs: expected null or one of {', '.join(RS_OPTIONS)}, found {rc.rollout_rs!r}"
        )
    elif rc.rollout_rs is not None:
        if rc.rollout_rs_threshold is None:
            out.append(f"rollout_correction.rollout_rs_threshold: required with rollout_rs {rc.rollout_rs}")
        else:
            try:
                rs_bounds(rc.rollout_rs, rc.rollout_rs_threshold)
            except ValueError as exc:
                out.append(f"rollout_correction.rollout_rs_threshold: {exc}")
    elif rc.rollout_rs_threshold is not None:
        out.append("rollout_correction.rollout_rs_threshold: only with rollout_rs (set it, or remove the threshold)")
    if rc.weighted_terms not in WEIGHTED_TERMS:
        out.append(
            f"rollout_correction.weighted_terms: expected all or policy (verl-omni's), found {rc.weighted_terms!r}"
        )
    elif rc.weighted_terms != "all" and not rc.enabled:
        out.append("rollout_correction.weighted_terms: only with rollout_is or rollout_rs (set one, or remove it)")
    if rc.enabled and trains_on != "steps":
        out.append(
            f"rollout_correction: {algorithm} trains on {trains_on.replace('_', ' ')}, not on the rollout's "
            "log-probs; remove the section"
        )
    return out
