"""The rank-0 sink of a run, shared by the trainer (``runtime/train/metrics.py``) and the RL job
(``runtime/rl/metrics.py``): every step's metrics to ``<log.dir>/metrics.jsonl`` and the trackers of
``log.report_to``, the console (``console.py``), files (plots, validation samples) to the trackers, and the
end-of-run curve PNG.

Every rank constructs it (other ranks with ``enabled=False``: every call is a no-op): opening the trackers is
collective, so a tracker that cannot start on rank 0 (no W&B credentials, an unreachable MLflow server) stops every
rank with the same one-line error instead of leaving them waiting in the first collective of the loop.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from runtime.config.errors import ConfigError
from runtime.train.tracking.backends import Trackers, open_tracker
from runtime.train.tracking.console import Console
from runtime.train.tracking.plots import Panel, plot_curves, run_history

__all__ = ["MetricsSink", "RunLog"]


_HINTS = {
    "tensorboard": "it writes <log.dir>/tb: check that log.dir is a writable directory",
    "wandb": "set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to keep the run in <log.dir>/wandb",
    "mlflow": "check MLFLOW_TRACKING_URI; unset, the run goes to the file store <log.dir>/mlruns",
}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _agree(error: str | None) -> None:
    """Raise rank 0's error on every rank (collective when torch.distributed is initialized)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        holder = [error]
        dist.broadcast_object_list(holder, src=0)
        error = holder[0]
    if error is not None:
        raise ConfigError(error)


class RunLog:
    def __init__(
        self,
        log: Any,  # the config's ``log`` section: dir, report_to, project, run_name, progress
        total_steps: int,
        enabled: bool,
        run_config: Mapping[str, Any] | None = None,
        start_step: int = 0,
        samples_per_step: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self.log_dir = Path(log.dir)
        self._jsonl = self.console = self.trackers = None
        error = None
        if enabled:
            stream = stream if stream is not None else sys.stdout  # the current stdout, not the one at import time
            self.log_dir.mkdir(parents=True, exist_ok=True)
            run_name = log.run_name or self.log_dir.resolve().name
            opened = []
            for name in log.report_to:
                try:
                    opened.append(open_tracker(name, self.log_dir, log.project, run_name, dict(run_config or {})))
                except Exception as exc:  # the tracker's own error (credentials, server, store): a user error
                    error = f"log.report_to: {name} could not start a run: {_first_line(exc)} ({_HINTS[name]})"
                    break
            self.trackers = Trackers(opened)
            if error is not None:
                self.trackers.close(failed=True)
            else:
                self._jsonl = (self.log_dir / "metrics.jsonl").open("a", encoding="utf-8")
                self.console = Console(stream, total_steps, start_step, log.progress, samples_per_step)
        _agree(error)

    def record(self, metrics: Mapping[str, Any]) -> None:
        """One step's metrics (a ``step`` key and numbers) to the JSONL file and every tracker."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(dict(metrics)) + "\n")
        self._jsonl.flush()
        self.trackers.log_metrics(metrics, metrics["step"])

    def say(self, line: str) -> None:
        if self.enabled:
            self.console.say(line)

    def show(self, step: int, line: str, postfix: str | None = None) -> None:
        """The console line of ``step`` (and the bar moved to it on a terminal)."""
        if self.enabled:
            self.console.advance(step, postfix)
            self.console.step_line(step, line)

    def advance(self, step: int, postfix: str | None = None) -> None:
        if self.enabled:
            self.console.advance(step, postfix)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        if self.enabled:
            self.trackers.log_file(tag, path, step)

    def plot(self, panels: Sequence[Panel], name: str, title: str, step: int) -> Path | None:
        """The curves of this run's ``metrics.jsonl`` as ``<log.dir>/<name>``, also sent to the trackers."""
        if not self.enabled:
            return None
        self._jsonl.flush()
        if importlib.util.find_spec("matplotlib") is None:  # the run's results matter more than its picture
            self.say(f"matplotlib is not installed (pip install 'patchgen[runtime]'): no {name}")
            return None
        path = plot_curves(run_history(self.log_dir / "metrics.jsonl"), panels, self.log_dir / name, title)
        if path is not None:
            self.trackers.log_file(f"plots/{Path(name).stem}", path, step)
            self.say(f"wrote {path}")
        return path

    def close(self) -> None:
        """Close the sinks; called from a ``finally``, a run ended by an exception is marked failed in the
        trackers (W&B exit code 1, MLflow status FAILED)."""
        failed = sys.exc_info()[0] is not None
        for sink in (self._jsonl, self.console):
            if sink is not None:
                sink.close()
        if self.trackers is not None:
            self.trackers.close(failed)
        self._jsonl = self.console = self.trackers = None


class MetricsSink:
    """Base of the trainer's and the RL job's metrics loggers (``runtime/train/metrics.py``,
    ``runtime/rl/metrics.py``): the ``RunLog`` every rank constructs (``enabled`` on rank 0 only), so both open and
    close a run the same way."""

    def __init__(
        self,
        log: Any,  # the config's ``log`` section
        total_steps: int,
        enabled: bool,
        run_config: Mapping[str, Any] | None = None,
        start_step: int = 0,
        samples_per_step: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled, self.total_steps = enabled, total_steps
        self.run = RunLog(log, total_steps, enabled, run_config, start_step, samples_per_step, stream)

    def say(self, line: str) -> None:
        self.run.say(line)

    def close(self) -> None:
        self.run.close()
