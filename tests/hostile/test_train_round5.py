"""Hostile inputs for the trainer and its companions (round 5): a checkpoint whose recorded learning-rate schedule was
edited (its hashes recomputed) and is followed under ``checkpoint.schedule_change: continue``, a truncated DiT
transformer (trainer, RL policy, DiffusionOPD teacher), stale or swapped wheels carried to the GPU machine
(``make gpu-wheels``), a plan whose micro-batch overflows torch's sizes.

Rule: a user error is one ``error:`` line naming the file (and key) and exit code 2, in seconds, no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.checkpoint import COMPLETE_MARKER
from tests.plan_configs import TINY_QWEN3
from tests.train.common import run_config, run_main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _module(module: str, *args: str, timeout: float = 120) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of ``python -m module *args`` in a subprocess."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout
    )
    return done.returncode, done.stderr.strip().splitlines()


# ------------------------------------------------------------------------------------------ plan: torch's own log


def test_a_plan_whose_tokens_overflow_torch_is_one_line_without_torch_log(tmp_path: Path) -> None:
    """10**11 tokens pass the plan file's checks but overflow a fake tensor's size: torch logs the failing kernel's
    traceback before raising, which buried the one-line error under ~30 lines."""
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump({"model": {"type": "qwen3", "config": TINY_QWEN3}, "workload": {"tokens": 10**11}}))
    code, lines = _module("runtime.plan", str(path), "--gpus", "1")
    assert code == 2 and len(lines) == 1, (code, lines[:3])
    assert lines[0].startswith(f"error: {path}: model: "), lines


# ------------------------------------------------------------------------------------------ forged saved schedule


@pytest.fixture(scope="module")
def saved_step2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny qwen3 run of 2 steps checkpointed at step 2, and its config."""
    root = tmp_path_factory.mktemp("saved")
    raw = run_config(root, train={"steps": 2}, checkpoint={"dir": str(root / "ckpt"), "interval": 2})
    assert run_main(raw, root)[0] == 0
    return root / "ckpt" / "step_000002", raw


def _forge_schedule(checkpoint: Path, key: str, value: object) -> Path:
    """Set ``extra.schedule[key]`` in rank 0's state and record the file's new hash in the marker: it verifies."""
    state_file = checkpoint / "rank_00000.json"
    state = json.loads(state_file.read_text())
    state["extra"]["schedule"][key] = value
    data = json.dumps(state).encode()  # NaN is written as JSON's NaN, which json (and the trainer) reads back
    state_file.write_bytes(data)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    marker["files"][state_file.name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))
    return state_file


FORGED = {
    "negative lr": ("optim.lr", -0.024, "must not be negative"),
    "NaN lr": ("optim.lr", float("nan"), "finite"),
    "min_lr_ratio far past 1": ("optim.min_lr_ratio", 1e30, "expected a ratio in [0, 1]"),
    "steps a string": ("train.steps", "3", "expected int"),
    "steps zero": ("train.steps", 0, "must be positive"),
    "negative warmup": ("optim.warmup_steps", -5, "must not be negative"),
    "unknown scheduler": ("optim.lr_scheduler_type", "cosine_forever", "expected one of"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_saved_schedule_is_refused_under_continue(saved_step2, tmp_path: Path, case: str) -> None:
    """``schedule_change: continue`` trains on the schedule the checkpoint recorded: before the fix an edited one
    trained step 3 at lr -0.024, 5.5e29 or NaN (exit 0), or stopped with a traceback (a string ``train.steps``)."""
    import shutil

    key, value, needle = FORGED[case]
    checkpoint = tmp_path / "ckpt" / saved_step2[0].name
    shutil.copytree(saved_step2[0], checkpoint)
    state_file = _forge_schedule(checkpoint, key, value)
    run = json.loads(json.dumps(saved_step2[1]))
    run["train"]["steps"] = 3
    run["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "resume": str(checkpoint), "schedule_change": "continue"}
    run["log"]["dir"] = str(tmp_path / "log")
    code, err = run_main(run, tmp_path)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err[-2000:])
    assert str(state_file) in lines[0] and f"extra.schedule.{key}: " in lines[0] and needle in lines[0], lines
    assert "Traceback" not in err and not (tmp_path / "ckpt" / "step_000003").exists()


# ------------------------------------------------------------------------------------------ truncated DiT weights


@pytest.fixture(scope="module")
def flux_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    return save_tiny_pipeline("flux", tmp_path_factory.mktemp("round5") / "flux")


def _truncated_copy(pipeline: Path, target: Path) -> Path:
    """A copy of ``pipeline`` whose transformer weights lost their last 100 bytes; the file cut short."""
    import shutil

    shutil.copytree(pipeline, target)
    weights = target / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return weights


def _one_truncation_line(code: int, err: str, weights: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err[-2000:])
    assert str(weights) in lines[0] and "not a whole safetensors file" in lines[0], lines
    assert "Traceback" not in err


def test_a_truncated_dit_transformer_is_one_line_for_the_trainer(flux_pipeline: Path, tmp_path: Path) -> None:
    """Found by the checks before the model is built (the launcher runs them too): it was safetensors'
    ``SafetensorError`` traceback (32-38 lines, exit 1) from the loader."""
    from runtime.data.dit.synthetic import write_synthetic_images

    weights = _truncated_copy(flux_pipeline, tmp_path / "flux")
    images = write_synthetic_images(tmp_path / "images", 2, 32, 48, seed=1)
    raw = {
        "model": {"type": "flux", "path": str(tmp_path / "flux"), "seed": 0},
        "data": {"path": str(images), "buckets": [[32, 48]], "cache": str(tmp_path / "cache")},
        "train": {"steps": 1},
        "log": {"dir": str(tmp_path / "log"), "progress": False},
    }
    _one_truncation_line(*run_main(raw, tmp_path), weights)


def test_a_truncated_transformer_is_a_value_error_naming_it_when_loaded(flux_pipeline: Path, tmp_path: Path) -> None:
    """The one place a DiT's weights are read (``read_weights``, under every ``from_pretrained``): what the loaders'
    callers report in one line, whatever path skipped the checks before."""
    from runtime.diffusion.registry import training_class

    weights = _truncated_copy(flux_pipeline, tmp_path / "flux")
    with pytest.raises(ValueError, match="not a whole safetensors file") as caught:
        training_class("flux").from_pretrained(tmp_path / "flux", subfolder="transformer")
    assert str(weights) in str(caught.value)


@pytest.mark.parametrize("which", ["policy", "teacher"])
def test_a_truncated_rl_transformer_is_one_line(flux_pipeline: Path, tmp_path: Path, which: str) -> None:
    """``runtime.rl`` (DiffusionOPD): the policy's ``model.path``, or its teacher's pipeline, cut short."""
    import contextlib
    import io
    import shutil

    from runtime.parallel.state import set_parallel_state
    from runtime.rl.__main__ import main
    from tests.rl.common import for_algorithm, rl_config

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    damaged, whole = (student, teacher) if which == "policy" else (teacher, student)
    weights = _truncated_copy(flux_pipeline, damaged)
    shutil.copytree(flux_pipeline, whole)
    raw = rl_config("flux", student, tmp_path)
    raw = for_algorithm(raw, "diffusionopd", teacher_model_path=str(teacher), distill_loss_mode="distill_kl")
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main([str(config)])
        finally:
            set_parallel_state(None)
    _one_truncation_line(code, err.getvalue(), weights)


# ------------------------------------------------------------------------------------------ carried GPU wheels


def _install_carried(dest: Path, target: Path) -> subprocess.CompletedProcess:
    """The device-side install of docs/performance.md ("GPU check"), into ``target``."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--require-hashes", "--no-index", "--find-links"]
    command += [str(dest), "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(target)]
    command += ["-r", str(dest / "requirements.txt")]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120)


def test_carried_wheels_replace_stale_ones_and_install_only_by_hash(tmp_path: Path) -> None:
    """``.whl/`` held whatever earlier downloads left and the device installed ``.whl/*.whl`` unverified: now the new
    wheels replace the old ones (other files kept), pinned by hash, and a wheel whose bytes changed is refused."""
    from tests.engine.helpers import PACKAGE, build_wheel

    stage, dest = tmp_path / "stage", tmp_path / ".whl"
    wheel = build_wheel(stage, "2.0.0")
    stale = build_wheel(dest, "1.0.0")
    (dest / "notes.txt").write_text("mine")
    code, lines = _module("bench.gpu_check.pin_wheels", str(stage), str(dest), "1")
    assert code == 0, lines
    assert [p.name for p in dest.glob("*.whl")] == [wheel.name] and not stale.exists()
    assert (dest / "notes.txt").read_text() == "mine"
    pins = (dest / "requirements.txt").read_text().splitlines()
    assert [line.split(" --hash=sha256:")[0] for line in pins] == [f"{PACKAGE}==2.0.0"], pins

    installed = _install_carried(dest, tmp_path / "site")
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "site" / f"{PACKAGE}-2.0.0.dist-info").is_dir()

    swapped = build_wheel(tmp_path / "other", "2.0.0", {f"{PACKAGE}.plain": "import os\n"})  # other bytes
    swapped.replace(dest / swapped.name)
    refused = _install_carried(dest, tmp_path / "site2")
    assert refused.returncode != 0 and "sha256" in refused.stderr, refused.stderr
    assert not (tmp_path / "site2" / PACKAGE).exists()


def test_a_wheel_missing_from_the_download_leaves_the_carried_ones(tmp_path: Path) -> None:
    from tests.engine.helpers import build_wheel

    stage, dest = tmp_path / "stage", tmp_path / ".whl"
    build_wheel(stage, "2.0.0")
    kept = build_wheel(dest, "1.0.0")
    code, lines = _module("bench.gpu_check.pin_wheels", str(stage), str(dest), "2")
    assert code == 1 and len(lines) == 1 and "1 wheels downloaded, expected 2" in lines[0], lines
    assert kept.exists() and not (dest / "requirements.txt").exists()
