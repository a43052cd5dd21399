"""The model and JPEG rewards in a real RL job on a tiny Flux: two iterations move the policy with finite losses, a
resumed run is bitwise the run that never stopped, and Ulysses SP=2 equals one process (every gradient within 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.rl.common import (
    assert_layout_matches,
    assert_resume_is_bitwise,
    one_iteration,
    references,
    rl_config,
    tiny_run,
)


@pytest.fixture(scope="module")
def reward_mix(tmp_path_factory) -> list[dict]:
    from runtime.rl.rewards.models import save_tiny_clip
    from runtime.rl.rewards.vlm import save_tiny_vlm

    root = tmp_path_factory.mktemp("reward_models")
    clip, vlm = save_tiny_clip(root / "clip"), save_tiny_vlm(root / "vlm")
    g = torch.Generator().manual_seed(0)
    head = {"layers.0.weight": torch.randn(4, 8, generator=g), "layers.0.bias": torch.zeros(4)}
    head |= {"layers.2.weight": torch.randn(1, 4, generator=g), "layers.2.bias": torch.zeros(1)}
    torch.save(head, root / "head.pth")
    return [
        {"jpeg_incompressibility": True, "weight": 0.5},
        {"aesthetic": str(clip), "head": str(root / "head.pth")},
        {"vlm_judge": str(vlm)},
        {"ocr": str(vlm), "max_new_tokens": 2},
    ]


def _raw(tiny_pipelines, work: Path, rewards: list[dict], **sections) -> dict:
    return rl_config("flux", tiny_pipelines("flux"), work, rewards=rewards, **sections)


def test_two_iterations_train_and_resume_bitwise(reward_mix, tiny_pipelines, tmp_path: Path) -> None:
    metrics, _ = tiny_run(_raw(tiny_pipelines, tmp_path, reward_mix))
    assert {"reward/jpeg_incompressibility0", "reward/aesthetic1", "reward/vlm_judge2", "reward/ocr3"} <= set(
        metrics[0]
    )
    (tmp_path / "resume").mkdir()
    assert_resume_is_bitwise(_raw(tiny_pipelines, tmp_path / "resume", reward_mix), tmp_path / "ckpt")


@pytest.mark.dist
def test_sp2_equals_one_process(reward_mix, tiny_pipelines, tmp_path: Path) -> None:
    raw = _raw(tiny_pipelines, tmp_path, reward_mix, lora={"rank": None})
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    for got in ranks:  # the rewards of every kind, the loss, the final latents and every gradient
        assert_layout_matches(got, ref, witness, metrics=("reward", "policy_loss"), scale={"policy_loss": 1.0})
