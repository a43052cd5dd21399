"""Rule: a resume never trains on weights that are not the run's, and a checkpoint the run cannot use is one line
naming the checkpoint (and the key or file), exit 2, before any weight is read from it. A checkpoint names the model
type and the model config it was saved with; one that names another, or none, is refused; a per-rank state edited
with recomputed hashes is refused; a ``checkpoint.resume`` path that is not there says which checkpoints are.

Every case runs the trainer's CLI in this process (``run_main``) on a tiny qwen3."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.checkpoint import COMPLETE_MARKER
from tests.train.common import TINY_MODEL, run_config, run_main


def _one_line_exit_2(code: int, stderr: str, *needles: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def no_weights_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal must come before DCP reads a single tensor of the checkpoint."""

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint weights were read before the checkpoint was refused")

    monkeypatch.setattr("runtime.checkpoint.dcp.dcp.load", refuse)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny qwen3 run of 3 steps with a checkpoint at each step, ``save_total_limit: 2`` (steps 2 and 3 are left);
    the cases resume step 2 (the same schedule: a changed ``train.steps`` is refused, tests/train/test_cli.py)."""
    root = tmp_path_factory.mktemp("saved")
    raw = run_config(
        root, train={"steps": 3}, checkpoint={"dir": str(root / "ckpt"), "interval": 1, "save_total_limit": 2}
    )
    assert run_main(raw, root)[0] == 0
    return root / "ckpt" / "step_000002", raw


def _resume(tmp_path: Path, checkpoint: Path, raw: dict, **model) -> tuple[int, str]:
    run = json.loads(json.dumps(raw))
    run["model"].update(model)
    run["checkpoint"] = {"dir": str(tmp_path / "new"), "resume": str(checkpoint)}
    run["log"]["dir"] = str(tmp_path / "log")
    return run_main(run, tmp_path)


def test_resume_under_another_model_type_is_refused(saved, tmp_path: Path, no_weights_read) -> None:
    """The qwen3 checkpoint resumed as llama (whose weights are a subset of qwen3's: DCP would load them and drop
    q_norm/k_norm silently) is refused, naming the checkpoint and model.type."""
    checkpoint, raw = saved
    line = _one_line_exit_2(*_resume(tmp_path, checkpoint, raw, type="llama"), str(checkpoint), "model.type")
    assert "qwen3" in line and "llama" in line
    assert not (tmp_path / "new").exists()


def test_resume_under_another_model_config_is_refused(saved, tmp_path: Path, no_weights_read) -> None:
    """Same type, same shapes, another config (rope_theta): the weights would load and mean something else."""
    checkpoint, raw = saved
    config = {**TINY_MODEL, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}
    _one_line_exit_2(*_resume(tmp_path, checkpoint, raw, config=config), str(checkpoint), "rope_theta")


def test_resume_under_the_same_model_continues(saved, tmp_path: Path) -> None:
    checkpoint, raw = saved
    assert _resume(tmp_path, checkpoint, raw) == (0, "")


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "ckpt" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return target


def _rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace file ``name`` and record its new size and sha256 in the marker: the checkpoint verifies."""
    (checkpoint / name).write_bytes(data)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    marker["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))


def test_checkpoint_without_its_model_is_refused(saved, tmp_path: Path, no_weights_read) -> None:
    checkpoint = _copy(saved[0], tmp_path)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    del marker["model"]
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))
    _one_line_exit_2(*_resume(tmp_path, checkpoint, saved[1]), str(checkpoint), "model")


def _set(path: list[str], value) -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        node = state
        for part in path[:-1]:
            node = node[part]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return edit


RANK_EDITS = {
    "cuda states that are not there": (_set(["rng", "cuda_devices"], 1), "rng"),
    "no python rng": (_set(["rng", "python"], KeyError), "rng"),
    "python rng version a string": (_set(["rng", "python", "version"], "x"), "rng"),
    "scheduler a string": (_set(["scheduler"], "garbage"), "scheduler"),
    "scheduler with another last_epoch type": (_set(["scheduler", "last_epoch"], "two"), "scheduler"),
    "extra without the data position": (_set(["extra", "data"], KeyError), "data"),
    "extra step a string": (_set(["extra", "step"], "2"), "step"),
    "data position of the wrong type": (_set(["extra", "data", "epoch"], [0]), "data"),
    "state a list": (lambda state: state.clear() or None, ""),
    "another rank's file": (_set(["rank"], 3), "rank"),
}


@pytest.mark.parametrize("case", list(RANK_EDITS))
def test_edited_rank_state_with_recomputed_hashes_is_one_line(saved, tmp_path: Path, case: str) -> None:
    checkpoint = _copy(saved[0], tmp_path)
    edit, needle = RANK_EDITS[case]
    state = json.loads((checkpoint / "rank_00000.json").read_text())
    edit(state)
    data = state if state else []
    _rewrite(checkpoint, "rank_00000.json", json.dumps(data).encode())
    _one_line_exit_2(*_resume(tmp_path, checkpoint, saved[1]), str(checkpoint), needle)


def test_rank_tensors_of_the_wrong_shape_are_one_line(saved, tmp_path: Path) -> None:
    from safetensors.torch import load, save

    checkpoint = _copy(saved[0], tmp_path)
    tensors = load((checkpoint / "rank_00000.safetensors").read_bytes())
    tensors["rng.torch"] = tensors["rng.torch"][:10].clone()
    _rewrite(checkpoint, "rank_00000.safetensors", save(tensors))
    _one_line_exit_2(*_resume(tmp_path, checkpoint, saved[1]), str(checkpoint), "rng.torch")


def test_resume_path_removed_by_keep_names_the_checkpoints_there(saved, tmp_path: Path) -> None:
    checkpoint, raw = saved
    gone = checkpoint.parent / "step_000001"  # pruned by save_total_limit: 2
    assert not gone.exists()
    line = _one_line_exit_2(*_resume(tmp_path, gone, raw), "checkpoint.resume", str(gone), "step_000002")
    assert "does not exist" in line
    empty = tmp_path / "nothing" / "step_000004"
    line = _one_line_exit_2(*_resume(tmp_path, empty, raw), "checkpoint.resume", str(empty))
    assert "no checkpoints" in line


def test_damaged_checkpoints_are_said_once(saved, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``resume: auto`` over damaged checkpoints only: the one-line error says it; no log record says it again (a
    warning reaches stderr through logging's last-resort handler when the CLI configures no logging)."""
    checkpoint = _copy(saved[0], tmp_path)
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    run = json.loads(json.dumps(saved[1]))
    run["checkpoint"] = {"dir": str(checkpoint.parent), "resume": "auto"}
    with caplog.at_level("WARNING"):
        _one_line_exit_2(*run_main(run, tmp_path), "checkpoint.resume", str(checkpoint), "sha256")
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")], caplog.records
