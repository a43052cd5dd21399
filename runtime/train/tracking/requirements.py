"""Is each tracker ``log.report_to`` names installed? Answered with ``importlib.util.find_spec`` (nothing imported:
no torch, no tracker library), so a missing one is a config error in the first second of a run, not after the model
is built."""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BACKENDS", "Backend", "missing_backend", "report_to_errors"]


@dataclass(frozen=True)
class Backend:
    module: str  # the package the tracker needs (find_spec name)
    install: str  # what to install: the project's extra and the pinned package


BACKENDS = {
    "tensorboard": Backend("tensorboard", "pip install 'patchgen[runtime]' (tensorboard==2.21.0)"),
    "wandb": Backend("wandb", "pip install 'patchgen[wandb]' (wandb==0.31.0)"),
    "mlflow": Backend("mlflow", "pip install 'patchgen[mlflow]' (mlflow-skinny==3.17.2)"),
}


def missing_backend(name: str) -> str | None:
    """What to install for the tracker ``name``, or None when it is installed (or is not a tracker name: the config's
    choice check names those)."""
    backend = BACKENDS.get(name)
    if backend is None or importlib.util.find_spec(backend.module) is not None:
        return None
    return f"{name} is not installed; {backend.install}"


def report_to_errors(report_to: Sequence[Any]) -> list[str]:
    """One line per bad entry of ``log.report_to``: not a tracker name, or a tracker that is not installed."""
    errors = []
    for index, name in enumerate(report_to):
        key = f"log.report_to[{index}]"
        if name not in BACKENDS:
            close = difflib.get_close_matches(str(name), list(BACKENDS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            errors.append(f"{key}: unknown value {name!r:.60}; expected one of {', '.join(BACKENDS)}{hint}")
            continue
        missing = missing_backend(name)
        if missing:
            errors.append(f"{key}: {missing}")
    return errors
