"""Per-iteration metrics of an RL run: every iteration to ``<log.dir>/metrics.jsonl`` (and tensorboard), a console
line every ``log.interval`` iterations, and alarm lines whenever an alarm fires (whatever the interval).

Keys (docs/flowgrpo.md, "Metrics"): ``step``; ``reward`` / ``reward_std`` (combined, over the global batch) and
``reward/<name>`` / ``reward_std/<name>`` per reward; ``advantage_mean`` / ``_std`` / ``_abs_max``;
``policy_loss``, ``clip_fraction``, ``approx_kl``, ``kl``, ``ratio_mean``, ``grad_norm``, ``lr``;
``logprob_gap_mean`` / ``logprob_gap_max`` (|log p_train - log p_rollout| over the first inner step's samples and
window steps, where the ratio must be 1); ``logprob_gap_alarm`` (1 when the max exceeded the threshold);
``skipped_nonfinite``; ``time_rollout`` / ``time_reward`` / ``time_train`` (seconds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = ["RLMetricsLogger"]

_SHOWN = (
    ("reward", "reward {:.4f}"),
    ("reward_std", "±{:.4f}"),
    ("policy_loss", "loss {:.3e}"),
    ("clip_fraction", "clip {:.3f}"),
    ("approx_kl", "kl~ {:.2e}"),
    ("logprob_gap_max", "|dlogp|max {:.1e}"),
    ("grad_norm", "grad {:.3f}"),
)


class RLMetricsLogger:
    """Rank-0 sink; with ``enabled=False`` (other ranks) every call is a no-op."""

    def __init__(
        self, log_dir: Path, total_steps: int, enabled: bool, tensorboard: bool, stream: TextIO | None = None
    ) -> None:
        self.enabled, self.total_steps = enabled, total_steps
        self.stream = stream if stream is not None else sys.stdout
        self._jsonl = self._writer = None
        if not enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (log_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("tensorboard not installed; logging to metrics.jsonl only", file=self.stream)
            else:
                self._writer = SummaryWriter(str(log_dir / "tb"))

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def log(self, metrics: dict[str, Any], echo: bool) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(metrics) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, int | float):
                    self._writer.add_scalar(key, value, metrics["step"])
        if echo:
            shown = " ".join(fmt.format(metrics[k]) for k, fmt in _SHOWN if metrics.get(k) is not None)
            self.say(f"step {metrics['step']:>5}/{self.total_steps} {shown}")

    def close(self) -> None:
        for sink in (self._jsonl, self._writer):
            if sink is not None:
                sink.close()
