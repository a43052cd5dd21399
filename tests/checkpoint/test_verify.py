"""Checkpoint integrity: the completion marker lists every file with its size and sha256, a damaged checkpoint is
named in a one-line error before anything is read from it, the newest intact checkpoint is found by skipping damaged
ones, and the per-rank state (RNG, scheduler, caller's extra) is safetensors + JSON, read without pickle."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import (
    COMPLETE_MARKER,
    CheckpointError,
    latest_intact_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from runtime.checkpoint.verify import FORMAT_VERSION
from tests.checkpoint.common import mlp, mlp_step


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """load_checkpoint restores RNG states into this process; give the other tests theirs back."""
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)


def _distcp(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def _noise(path: Path) -> None:
    """Overwrite up to 4 KiB in the middle of the file with random bytes (the size stays the same)."""
    data = bytearray(path.read_bytes())
    n = min(4096, len(data) // 2)
    start = (len(data) - n) // 2
    data[start : start + n] = os.urandom(n)
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_marker(ckpt: Path, **changes) -> None:
    marker = json.loads((ckpt / COMPLETE_MARKER).read_text())
    (ckpt / COMPLETE_MARKER).write_text(json.dumps({**marker, **changes}))


_NO_FILES = json.dumps({"format_version": FORMAT_VERSION, "step": 2, "world_size": 1})
DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "noise in a shard": (lambda c: _noise(_distcp(c)), "sha256"),
    "truncated shard": (lambda c: _truncate(_distcp(c)), "size"),
    "garbage .metadata": (lambda c: (c / ".metadata").write_bytes(os.urandom((c / ".metadata").stat().st_size)), ""),
    "missing shard": (lambda c: _distcp(c).unlink(), "missing"),
    "edited rank state": (lambda c: _noise(c / "rank_00000.json"), ""),
    "marker not json": (lambda c: (c / COMPLETE_MARKER).write_text("{not json"), COMPLETE_MARKER),
    "marker without files": (lambda c: (c / COMPLETE_MARKER).write_text(_NO_FILES), "lists no files"),
    "old format": (lambda c: _edit_marker(c, format_version=1), "format version 1"),
}


def _two_checkpoints(root: Path) -> None:
    model, optimizer, scheduler = mlp()
    for step in (1, 2):
        mlp_step(model, optimizer, scheduler, step)
        save_checkpoint(root, step, model, optimizer, scheduler, extra={"step": step})


def test_damaged_checkpoints_are_named_and_skipped(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"
    _two_checkpoints(pristine)
    marker = json.loads((pristine / "step_000002" / COMPLETE_MARKER).read_text())
    on_disk = sorted(p.name for p in (pristine / "step_000002").iterdir() if p.name != COMPLETE_MARKER)
    assert sorted(marker["files"]) == on_disk
    for entry, name in zip(marker["files"].values(), on_disk, strict=True):
        assert entry["size"] == (pristine / "step_000002" / name).stat().st_size and len(entry["sha256"]) == 64
    verify_checkpoint(pristine / "step_000002")

    for k, (kind, (damage, needle)) in enumerate(DAMAGE.items()):
        root = tmp_path / f"case{k}"
        shutil.copytree(pristine, root)
        damaged = root / "step_000002"
        damage(damaged)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(damaged, *mlp(seed=1))
        message = str(info.value)
        assert "\n" not in message and str(damaged) in message and needle in message, (kind, message)
        found, skipped = latest_intact_checkpoint(root)
        assert found == root / "step_000001", kind
        assert [str(e) for e in skipped] == [message], kind
        assert load_checkpoint(found, *mlp(seed=1)) == {"step": 1}


def test_every_checkpoint_damaged_finds_none(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    for step in (1, 2):
        _noise(_distcp(tmp_path / f"step_{step:06d}"))
    found, skipped = latest_intact_checkpoint(tmp_path)
    assert found is None and len(skipped) == 2
    assert latest_intact_checkpoint(tmp_path / "nothing-here") == (None, [])


def test_hashes_are_taken_while_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's shards and metadata are hashed as they are written, not read back afterwards."""
    from runtime.checkpoint import verify

    def no_reading(path: Path) -> str:
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(verify, "hash_file", no_reading)
    model, optimizer, scheduler = mlp()
    mlp_step(model, optimizer, scheduler, 0)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    monkeypatch.undo()
    verify_checkpoint(path)


def test_rank_state_is_safetensors_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pickle of ours: per-rank files are safetensors + JSON, and loading never unpickles beyond weights-only."""
    from safetensors.torch import load_file

    model, optimizer, scheduler = mlp()
    mlp_step(model, optimizer, scheduler, 0)
    random.seed(11)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, extra={"step": 1, "data": {"epoch": 0}})
    expected_random = random.random()
    names = sorted(p.name for p in path.iterdir())
    assert [n for n in names if n.startswith("rank_")] == ["rank_00000.json", "rank_00000.safetensors"]
    others = set(names) - {".metadata", COMPLETE_MARKER, "rank_00000.json", "rank_00000.safetensors"}
    assert others and all(n.endswith(".distcp") for n in others)  # DCP's shards
    state = json.loads((path / "rank_00000.json").read_text())
    assert state["extra"] == {"step": 1, "data": {"epoch": 0}} and state["scheduler"]["last_epoch"] == 1
    assert torch.equal(load_file(path / "rank_00000.safetensors")["rng.torch"], torch.get_rng_state())

    real_load = torch.load

    def weights_only_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", weights_only_load)
    random.seed(99)
    assert load_checkpoint(path, *mlp(seed=3)) == {"step": 1, "data": {"epoch": 0}}
    assert random.random() == expected_random

    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(
            tmp_path, 2, model, optimizer, scheduler, extra={"when": (1, 2)}
        )  # a tuple would come back a list
    assert not (tmp_path / "step_000002").exists() and not (tmp_path / ".step_000002.tmp").exists()


def test_crafted_metadata_runs_no_code(tmp_path: Path) -> None:
    """A .metadata that would call a function when unpickled is refused even when the marker's hash matches it."""
    import pickle

    model, optimizer, scheduler = mlp()
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    (path / ".metadata").write_bytes(pickle.dumps(os.getcwd))  # a global outside DCP's metadata classes
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    marker["files"][".metadata"] = {
        "size": (path / ".metadata").stat().st_size,
        "sha256": hashlib.sha256((path / ".metadata").read_bytes()).hexdigest(),
    }
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"refusing its \.metadata: posix\.getcwd is not allowed"):
        load_checkpoint(path, *mlp())


def test_rng_state_round_trips_through_safetensors_and_json() -> None:
    """Every generator's state comes back exactly, CUDA ones included (as byte tensors, as on a GPU machine)."""
    import numpy as np
    from safetensors.torch import load, save

    from runtime.checkpoint.dcp import get_rng_state, rng_from_files, rng_to_files

    random.seed(3)
    random.gauss(0, 1)  # leaves a cached gauss_next
    np.random.seed(4)
    np.random.standard_normal()  # numpy's cached gaussian
    state = get_rng_state()
    state["cuda"] = [
        torch.randint(0, 256, (16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(d)) for d in range(2)
    ]
    tensors, data = rng_to_files(state)
    back = rng_from_files(load(save(tensors)), json.loads(json.dumps(data)))
    assert back["python"] == state["python"]
    assert torch.equal(back["torch"], state["torch"])
    assert all(torch.equal(a, b) for a, b in zip(back["cuda"], state["cuda"], strict=True))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    assert back["numpy"][0] == kind and np.array_equal(back["numpy"][1], keys) and back["numpy"][1].dtype == keys.dtype
    assert back["numpy"][2:] == (pos, has_gauss, cached)
