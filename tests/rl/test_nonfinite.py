"""A non-finite loss or learning rate in the RL job (``runtime/train/finite.py`` through ``update``): ``stop`` names
the iteration and the samples' prompts and leaves the weights as they were; ``skip`` skips and counts the update; a
learning rate that turns non-finite stops before the step whatever the mode. Driven through the job's own iteration
on a tiny SD3 pipeline, with a broken (NaN) frozen reference feeding the KL term."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.rl.common import rl_config, start, trainable_state


def _run(tiny_pipelines, tmp_path: Path, mode: str) -> object:
    raw = rl_config(
        "sd3",
        tiny_pipelines("sd3"),
        tmp_path,
        flowgrpo={"kl_coef": 0.1},
        reference="frozen_copy",
        train={"nonfinite": mode},
    )
    run, _ = start(raw)
    with torch.no_grad():
        p = next(p for p in run.policy.reference.parameters() if p.dim() > 1)
        p.fill_(float("nan"))  # a broken reference model: the KL, hence the loss, is NaN
    return run


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_loss_stops_naming_the_prompts(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.rl.loop import iteration
    from runtime.train.finite import NonFiniteError

    run = _run(tiny_pipelines, tmp_path, "stop")
    before = trainable_state(run.policy)
    with pytest.raises(NonFiniteError) as caught:
        iteration(run, 1)
    message = str(caught.value)
    assert message.startswith("step 1 (inner epoch 0): the loss"), message
    assert "(sample 0)" in message and "train.nonfinite: skip" in message
    assert _same(trainable_state(run.policy), before)


def test_nan_loss_skips_and_infinite_lr_stops(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.rl.loop import iteration
    from runtime.train.finite import NonFiniteError

    run = _run(tiny_pipelines, tmp_path, "skip")
    before = trainable_state(run.policy)
    metrics, _ = iteration(run, 1)
    assert metrics["skipped_nonfinite"] == 1
    assert _same(trainable_state(run.policy), before)

    for group in run.optimizer.param_groups:
        group["lr"] = math.inf  # a schedule gone wrong: only the learning rate is non-finite
    with pytest.raises(NonFiniteError, match="optim.lr"):
        iteration(run, 2)
    assert _same(trainable_state(run.policy), before)
