"""Atomicity: a save killed with SIGKILL leaves the previous checkpoint usable; only complete ones are found."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from tests.checkpoint.common import mlp, mlp_step

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """load_checkpoint restores RNG states into this process; give the other tests theirs back."""
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited with {proc.returncode} before the kill:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("child never reached the middle of its second save")
        time.sleep(0.05)


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    log = tmp_path / "child.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint.kill_child", str(root)],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(tmp_path / "ready", proc, log)
    finally:
        proc.kill()  # SIGKILL: no cleanup handlers, no flushes
        proc.wait(timeout=30)
    assert proc.returncode == -9

    stale = root / ".step_000002.tmp"
    assert (stale / ".metadata").is_file()  # step 2's shards were on disk, the save was not complete
    assert not (root / "step_000002").exists()
    assert latest_checkpoint(root) == root / "step_000001"

    expected = torch.load(tmp_path / "expected.pt")
    model, optimizer, scheduler = mlp(seed=123)  # different weights: they must come from the checkpoint
    torch.manual_seed(999)
    extra = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
    assert extra == {"step": 1}
    assert torch.equal(torch.get_rng_state(), expected["rng"])
    assert scheduler.get_last_lr() == expected["lr"] and scheduler.last_epoch == 1
    for name, value in expected["params"].items():
        assert torch.equal(model.state_dict()[name], value), name
    assert optimizer.state_dict()["state"][0]["step"].item() == 1

    # Resumable: the next save of step 2 replaces the leftovers.
    mlp_step(model, optimizer, scheduler, 1)
    path = save_checkpoint(root, 2, model, optimizer, scheduler, extra={"step": 2})
    assert path == root / "step_000002" == latest_checkpoint(root)
    assert not stale.exists()
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]


def test_only_complete_checkpoints_are_found_and_loaded(tmp_path: Path) -> None:
    model, optimizer, scheduler = mlp()
    assert latest_checkpoint(tmp_path / "missing") is None
    save_checkpoint(tmp_path, 5, model, optimizer, scheduler)
    save_checkpoint(tmp_path, 12, model, optimizer, scheduler)
    (tmp_path / "step_000099").mkdir()  # no marker: e.g. copied by hand, half-way
    (tmp_path / ".step_000100.tmp").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005", "step_000012"]
    with pytest.raises(CheckpointError, match="is not complete"):
        load_checkpoint(tmp_path / "step_000099", model, optimizer, scheduler)


def test_resave_replaces_and_keep_prunes(tmp_path: Path) -> None:
    model, optimizer, scheduler = mlp()
    for step in range(3):
        mlp_step(model, optimizer, scheduler, step)
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, extra={"step": step, "v": 1})
    save_checkpoint(tmp_path, 2, model, optimizer, scheduler, extra={"step": 2, "v": 2}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
    assert load_checkpoint(tmp_path / "step_000002", *mlp(seed=1)) == {"step": 2, "v": 2}


def test_save_is_rng_neutral(tmp_path: Path) -> None:
    model, optimizer, scheduler = mlp()
    mlp_step(model, optimizer, scheduler, 0)
    before = torch.get_rng_state(), random.getstate()
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


def test_keep_never_prunes_the_checkpoint_just_written(tmp_path: Path) -> None:
    model, optimizer, scheduler = mlp()
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, model, optimizer, scheduler)
    save_checkpoint(tmp_path, 11, model, optimizer, scheduler, keep=2)  # e.g. re-run from step 10
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000011", "step_000030"]
    with pytest.raises(TypeError, match="JSON data"):
        save_checkpoint(tmp_path, 12, model, optimizer, scheduler, extra={"f": lambda: 0})
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
