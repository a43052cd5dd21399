"""Which proof a training job runs before step 1, and an RL job before its first iteration
(``runtime/train/self_check.py``: what a proof is and why), by the family of its model; a family without one yet says
so and the run goes on."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from runtime.config.common import SelfCheckConfig
from runtime.models.registry import lookup
from runtime.parallel.parallelize import ParallelPlan, watch_sites
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig
from runtime.train.job import parallel_plan, site_plan, train_device
from runtime.train.self_check import Proof, run_proof, untouched_rng
from runtime.train.summary import say

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig

__all__ = ["OFF_KEY", "PROVEN_FAMILIES", "off_line", "self_check", "self_check_policy"]

OFF_KEY = "train.self_check"
PROVEN_FAMILIES = ("causal_lm", "vlm", "omni", "dit")


def off_line(section: SelfCheckConfig) -> str:
    """The start-up line of a run that skips its proof: it says the layout is unproven and why."""
    return f"self-check: OFF, this run's layout is unproven ({OFF_KEY}.reason: {section.reason})"


def self_check(config: RunConfig, state: ParallelState, model: torch.nn.Module, **classes: Any) -> None:
    """Prove the job's layout on a shrunk copy of ``model``'s config (the job's built model: its config is exactly
    what trains), print the start-up line (rank 0), or stop the run (``ConfigError``, every rank). ``classes``:
    ``model_class`` / ``upstream_class`` in place of the registry's (tests plant defects through them)."""
    family = lookup(config.model.type).family
    if not config.train.self_check.enabled:
        say(state, off_line(config.train.self_check))
        return
    if family not in PROVEN_FAMILIES:
        say(state, f"self-check: not available for {family} yet")
        return
    if family == "dit":
        from runtime.train.self_check_dit import prove_dit

        def prove() -> Proof:
            return prove_dit(config.model.type, parallel_plan(config), state, model.config, **classes)
    else:
        from runtime.train.self_check_text import prove_text

        def prove() -> Proof:
            return prove_text(config, state, model.config, **classes)

    with untouched_rng(train_device(state)):
        proof = run_proof(prove, OFF_KEY, lambda line: say(state, line), state.loss_group)
    watch_sites(model, state, replace(parallel_plan(config), mixer_classes=proof.mixers))


def self_check_policy(config: RLConfig, state: ParallelState, module: torch.nn.Module) -> None:
    """The RL job's proof before its first iteration: its policy's DiT under the layout and plan the policy was
    sharded with (``runtime/rl/policy.py``); a non-diffusers policy says that no proof exists for it yet."""
    if not config.train.self_check.enabled:
        say(state, off_line(config.train.self_check))
        return
    if config.model.type is None:
        say(state, f"self-check: not available for {config.model.architecture} yet")
        return
    from runtime.train.self_check_dit import prove_dit

    plan = ParallelPlan(
        mixed_precision=config.train.mixed_precision,
        activation_checkpointing=config.parallel.activation_checkpointing,
        **site_plan(config.model.type),
    )
    with untouched_rng(train_device(state)):
        proof = run_proof(
            lambda: prove_dit(config.model.type, plan, state, module.config),
            OFF_KEY,
            lambda line: say(state, line),
            state.loss_group,
        )
    watch_sites(module, state, replace(plan, mixer_classes=proof.mixers))
