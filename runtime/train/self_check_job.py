"""Which proof a training job runs before step 1 (``runtime/train/self_check.py``: what a proof is and why), by the
family of its model; a family without one yet says so and the run goes on."""

from __future__ import annotations

from typing import Any

import torch

from runtime.models.registry import lookup
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig
from runtime.train.job import train_device
from runtime.train.self_check import run_proof, untouched_rng
from runtime.train.summary import say

__all__ = ["OFF_KEY", "PROVEN_FAMILIES", "self_check"]

OFF_KEY = "train.self_check"
PROVEN_FAMILIES = ("causal_lm",)


def self_check(config: RunConfig, state: ParallelState, model: torch.nn.Module, **classes: Any) -> None:
    """Prove the job's layout on a shrunk copy of ``model``'s config (the job's built model: its config is exactly
    what trains), print the start-up line (rank 0), or stop the run (``ConfigError``, every rank). ``classes``:
    ``model_class`` / ``upstream_class`` in place of the registry's (tests plant defects through them)."""
    family = lookup(config.model.type).family
    if not config.train.self_check:
        say(state, f"self-check: off ({OFF_KEY}: false)")
        return
    if family not in PROVEN_FAMILIES:
        say(state, f"self-check: not available for {family} yet")
        return
    from runtime.train.self_check_text import prove_text

    with untouched_rng(train_device(state)):
        run_proof(
            lambda: prove_text(config, state, model.config, **classes),
            OFF_KEY,
            lambda line: say(state, line),
            state.loss_group,
        )
