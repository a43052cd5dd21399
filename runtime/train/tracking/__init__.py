"""Where a run's metrics, plots and samples go: ``<log.dir>/metrics.jsonl`` always, and the experiment trackers named
by ``log.report_to`` (TensorBoard, Weights & Biases, MLflow) through their own libraries.

Modules: ``requirements`` (is a named tracker installed; no torch import, so a config check costs nothing),
``backends`` (the trackers behind one interface), ``run_log`` (the rank-0 sink the trainer and the RL job share:
JSONL, trackers, console lines with timestamp / elapsed / ETA / throughput or the tqdm bar), ``plots`` (the
end-of-run curve PNG, matplotlib).
"""

from runtime.train.tracking.requirements import BACKENDS, missing_backend

__all__ = ["BACKENDS", "missing_backend"]
