"""Per-iteration metrics of an RL run: every iteration to ``<log.dir>/metrics.jsonl`` and the trackers of
``log.report_to`` (TensorBoard, W&B, MLflow), a console line every ``log.interval`` iterations (off a terminal with
timestamp, elapsed time, ETA and samples/s), alarm lines whenever an alarm fires (whatever the interval), and at the
end ``<log.dir>/reward_loss.png``: the reward (± its std), each reward of a mix, and the policy loss (offline DPO,
which scores nothing: ``loss.png``, its loss and implicit reward accuracy, both also on its console line).

Keys (docs/flowgrpo.md, "Metrics"): ``step``; ``reward`` / ``reward_std`` (combined, over the global batch) and
``reward/<name>`` / ``reward_std/<name>`` per reward; ``advantage_mean`` / ``_std`` / ``_abs_max``;
``zero_std_ratio`` (share of groups with equal rewards); ``policy_loss``, ``clip_fraction`` (and its
``clip_fraction_high`` / ``clip_fraction_low`` sides; GSPO with ``gspo_clip_fraction: verl``: verl's, where the clip
binds, low side 0), ``approx_kl``, ``kl``, ``ratio_mean``, ``ratio_std`` (divisor ``n - ratio_std_ddof`` over the
micro-batch; ``runtime/rl/algorithms/objectives.py`` defines them all), ``grad_norm``, ``lr``;
``samples_per_second_per_gpu`` (images or videos of the global batch per second of the iteration per process:
verl-omni's img/GPU/s);
``logprob_gap_mean`` / ``logprob_gap_max`` (|log p_train - log p_rollout| over the first inner step's samples and
window steps, where the ratio must be 1); ``logprob_gap_alarm`` (1 when the max exceeded the threshold);
``skipped_nonfinite``; ``wall_time_<phase>`` (wall seconds: what a user waits) and ``cpu_time_<phase>`` (user CPU
seconds of this process, ``runtime.kernels.timing``: what the phase costs whatever else the machine runs) for the
phases ``rollout``, ``reward``, ``train`` (with ``async_reward`` the rollout phase decodes and hands each chunk to
the scorer, and ``reward`` is only the wait for the chunks still being scored);
``rollout_corr/<name>`` with ``rollout_correction`` on (verl-omni's names, ``runtime/rl/rollout_correction.py``):
``rollout_is_mean`` / ``_max`` / ``_min`` / ``_eff_sample_size`` / ``_ratio_fraction_high`` / ``_low``,
``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction``, ``kl``, ``k3_kl``, ``log_ppl_diff``,
``log_ppl_abs_diff``, ``chi2_token``, ``chi2_seq``, ``logprob_abs_diff_mean`` / ``_max``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.train.tracking.plots import Panel
from runtime.train.tracking.run_log import MetricsSink

__all__ = ["OFFLINE_PANELS", "PHASES", "REWARD_PANELS", "RLMetricsLogger", "TIMING_KEYS", "console_fields"]

PHASES = ("rollout", "reward", "train")
# the keys whose values are timings (they differ between two runs that compute the same thing)
TIMING_KEYS = (
    *(f"{kind}_time_{phase}" for kind in ("wall", "cpu") for phase in PHASES),
    "samples_per_second_per_gpu",
)

_SHOWN = (
    ("reward", "reward {:.4f}"),
    ("reward_std", "±{:.4f}"),
    ("policy_loss", "loss {:.3e}"),
    ("implicit_reward_accuracy", "reward_acc {:.3f}"),  # offline DPO: share of pairs the implicit reward gets right
    ("implicit_reward_margin", "margin {:.3e}"),
    ("clip_fraction", "clip {:.3f}"),
    ("approx_kl", "kl~ {:.2e}"),
    ("logprob_gap_max", "|dlogp|max {:.1e}"),
    ("rollout_corr/rollout_is_mean", "is {:.3f}"),  # rollout correction (verl-omni's names)
    ("rollout_corr/rollout_rs_masked_fraction", "rs_masked {:.3f}"),
    ("rollout_corr/kl", "rollout_kl {:.1e}"),
    ("grad_norm", "grad {:.3g}"),  # significant digits: DiffusionNFT's norms are about 1e-4 (0.000 in fixed ones)
)

# The end-of-run plot (``<log.dir>/reward_loss.png``): the combined reward (± its std over the batch), each reward,
# and the policy loss.
REWARD_PANELS = (
    Panel("reward", ("reward",), band=(("reward", "reward_std"),)),
    Panel("policy loss", ("policy_loss",)),
)
# An offline run (DPO) scores nothing: ``<log.dir>/loss.png`` plots its loss and the implicit reward's accuracy.
OFFLINE_PANELS = (
    Panel("policy loss", ("policy_loss",)),
    Panel("implicit reward accuracy", ("implicit_reward_accuracy",)),
)


def console_fields(metrics: dict[str, Any]) -> str:
    """The console line's fields of one iteration's ``metrics`` (those it has, in ``_SHOWN``'s order and formats)."""
    return " ".join(fmt.format(metrics[k]) for k, fmt in _SHOWN if metrics.get(k) is not None)


class RLMetricsLogger(MetricsSink):
    """Rank-0 sink (``runtime/train/tracking/run_log.py``): every iteration to ``metrics.jsonl`` and the trackers of
    ``log.report_to``, a console line every ``log.interval`` iterations, the reward/loss PNG at the end. With
    ``enabled=False`` (other ranks) every call is a no-op; constructing it is collective."""

    def log(self, metrics: dict[str, Any], echo: bool) -> None:
        if not self.enabled:
            return
        self.run.record(metrics)
        if echo:
            shown = console_fields(metrics)
            reward = metrics.get("reward")
            self.run.show(
                metrics["step"],
                f"step {metrics['step']:>5}/{self.total_steps} {shown}",
                postfix=None if reward is None else f"reward {reward:.4f}",
            )
        else:
            self.run.advance(metrics["step"])

    def finish(self, step: int, reward_names: list[str] | None = None, offline: bool = False) -> Path | None:
        """At the end of a run: ``<log.dir>/reward_loss.png`` (an offline run: ``loss.png``) written and sent to the
        trackers."""
        if offline:
            title = f"{self.run.log_dir.resolve().name}: loss and implicit reward accuracy"
            return self.run.plot(OFFLINE_PANELS, "loss.png", title, step)
        panels = list(REWARD_PANELS)
        if reward_names and len(reward_names) > 1:  # each reward of a mix beside the combined one
            panels.insert(1, Panel("rewards", tuple(f"reward/{n}" for n in reward_names)))
        title = f"{self.run.log_dir.resolve().name}: reward and policy loss"
        return self.run.plot(panels, "reward_loss.png", title, step)
