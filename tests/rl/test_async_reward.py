"""Async reward (``runtime/rl/async_reward.py``): each rollout chunk scored in the background while the next rolls out
gives synchronous scoring's rewards, update and weights bitwise (the rewards here score each sample alone), trains,
resumes bitwise, and under SP=2 or with the rewards on one rank for two replicas equals one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rl.common import assert_resume_is_bitwise, rl_config, start, tiny_run, trainable_state

# three chunks of the four samples (2 prompts x 2): the last chunk is one sample
CHUNKED = {"height": 32, "width": 48, "num_inference_steps": 4, "batch_size": 2}
REWARDS = [
    {"callable": "tests.rl.rewards:brightness"},
    {"callable": "tests.rl.rewards:redness", "weight": 0.5, "name": "redness"},
]


def _raw(tiny_pipelines, tmp_path: Path, asynchronous: bool, **sections: Any) -> dict:
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, sampling=CHUNKED, rewards=REWARDS, **sections)
    return {**raw, "async_reward": asynchronous}


def test_async_reward_is_synchronous_scoring_bitwise(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.rl.loop import iteration
    from runtime.rl.metrics import TIMING_KEYS

    out = []
    for asynchronous in (False, True):
        work = tmp_path / str(asynchronous)
        work.mkdir()
        run, _ = start(_raw(tiny_pipelines, work, asynchronous))
        metrics = [iteration(run, step)[0] for step in (1, 2)]
        out.append(
            ([{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics], trainable_state(run.policy))
        )
    assert out[0][0] == out[1][0]
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


def test_async_reward_trains_and_resumes_bitwise(tiny_pipelines, tmp_path: Path) -> None:
    raw = _raw(tiny_pipelines, tmp_path, True)
    metrics, _ = tiny_run(raw)
    assert all("reward/redness" in m for m in metrics)
    assert_resume_is_bitwise(raw, tmp_path / "ckpt")


def test_async_reward_key_is_a_bool(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    with pytest.raises(ConfigError, match="async_reward: must not be null|async_reward: expected bool"):
        parse_rl_config({**_raw(tiny_pipelines, tmp_path, True), "async_reward": "yes"})


@pytest.mark.dist
def test_async_reward_sp2_equals_one_process(tiny_pipelines, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import GROUPS_OF_3, _compare

    raw = _raw(tiny_pipelines, tmp_path, True, lora={"rank": None}, flowgrpo=GROUPS_OF_3)
    ref, witness = references(one_iteration, {**raw, "async_reward": False})
    for got in run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300):
        _compare(got, ref, witness, metrics=("policy_loss", "reward"))


@pytest.mark.dist
def test_async_reward_on_one_rank_for_both_replicas(tiny_pipelines, tmp_path: Path) -> None:
    """``reward_ranks: [1]`` and async: rank 1 scores both replicas' chunks as they come; the rewards and the update
    are one synchronous process's (test_job_dist's comparison)."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import GROUPS_OF_3, _compare

    layout = {**GROUPS_OF_3, "micro_batch_size": 3}
    raw = _raw(tiny_pipelines, tmp_path, False, lora={"rank": None}, flowgrpo=layout)
    ref, witness = references(one_iteration, raw)
    two = {**raw, "data": {**raw["data"], "prompts_per_step": 1}, "reward_ranks": [1], "async_reward": True}
    for got in run_distributed(one_iteration, 2, two, timeout=300):
        _compare(got, ref, witness, latents=False, metrics=("policy_loss", "reward", "reward/redness"))


def test_a_failing_reward_stops_the_async_step_in_one_line(tiny_pipelines, tmp_path: Path) -> None:
    """A chunk's reward error reaches the loop as synchronous scoring's (one line naming the reward and chunk size)."""
    from runtime.rl.loop import iteration
    from runtime.rl.rewards import RewardError

    raw = _raw(tiny_pipelines, tmp_path, True)
    run, _ = start({**raw, "rewards": [{"callable": "tests.rl.rewards:wrong_count"}]})
    with pytest.raises(RewardError, match="reward 'callable0' returned 1 values for 2 samples"):
        iteration(run, 1)
