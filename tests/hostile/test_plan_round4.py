"""Hostile plan files and arguments for ``python -m runtime.plan`` (round 4).

Rule checked by every case here: a bad plan file or argument exits with code 2 and prints one line per problem,
each ``error: ...`` naming the file (and key) or the argument, every problem of every file at once, in seconds,
without a traceback; ``model.config`` is checked as the trainer checks it (its config class's keys, the trainer's
size limits, ``runtime/train/model_keys.py`` and ``runtime/train/model_limits.py``).

Each command runs in a subprocess with a deadline: before the fixes some of these planned for minutes or forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.plan_configs import TINY_QWEN3 as TINY

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 60  # seconds; a checked error answers in about one (no torch import)


def _plan(path: Path, config: dict, model_type: str = "qwen3", workload: dict | None = None) -> Path:
    raw = {"model": {"type": model_type, "config": config}, "workload": workload or {"tokens": 64}}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _run(*args: str) -> tuple[int, list[str], float]:
    """(exit code, stderr lines, seconds) of ``python -m runtime.plan *args``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "runtime.plan", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=DEADLINE,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m runtime.plan {' '.join(args)[:200]}: still running after {DEADLINE} s")
    return done.returncode, done.stderr.strip().splitlines(), time.monotonic() - started


def _assert_user_error(code: int, lines: list[str], count: int) -> None:
    assert code == 2, (code, lines)
    assert len(lines) == count, lines
    assert all(line.startswith("error: ") for line in lines), lines
    assert not any("Traceback" in line for line in lines), lines


def test_a_misspelt_model_config_key_is_an_error_not_the_default_size(tmp_path: Path) -> None:
    path = _plan(tmp_path / "typo.yaml", {**{k: v for k, v in TINY.items() if k != "hidden_size"}, "hiden_size": 64})
    code, lines, _ = _run(str(path), "--gpus", "1")
    _assert_user_error(code, lines, 1)
    assert str(path) in lines[0] and "model.config.hiden_size" in lines[0], lines
    assert "unknown key for Qwen3Config" in lines[0] and "did you mean 'hidden_size'" in lines[0], lines


def test_a_misspelt_dit_config_key_is_an_error(tmp_path: Path) -> None:
    """A DiT's config: the keys of the generated diffusers class's ``__init__`` (read from source, no import)."""
    path = _plan(
        tmp_path / "wan.yaml",
        {"num_layer": 2, "num_attention_heads": 2, "attention_head_dim": 8},
        model_type="wan",
        workload={"frames": 1, "height": 16, "width": 16, "text_tokens": 4},
    )
    code, lines, _ = _run(str(path))
    _assert_user_error(code, lines, 1)
    assert "model.config.num_layer" in lines[0] and "did you mean 'num_layers'" in lines[0], lines


def test_sizes_gpu_counts_and_gpu_memory_are_bounded_all_at_once(tmp_path: Path) -> None:
    """Negative sizes, a billion layers, a trillion GPUs, zero GPUs and a NaN memory: five lines, within seconds."""
    path = _plan(tmp_path / "sizes.yaml", {**TINY, "hidden_size": -64, "num_hidden_layers": 10**9})
    code, lines, seconds = _run(str(path), "--gpus", str(10**12), "0", "--gpu-mem", "nan")
    _assert_user_error(code, lines, 5)
    text = "\n".join(lines)
    for needle in (
        "model.config.hidden_size: expected an integer in [1, 1048576]",
        "model.config.num_hidden_layers: expected an integer in [1, 1024]",
        f"--gpus: {10**12}",
        "--gpus: 0",
        "--gpu-mem: nan",
    ):
        assert needle in text, (needle, lines)
    assert seconds < 30, seconds


@pytest.mark.parametrize("memory", ["inf", "-inf", "1e400", "0", "-8"])
def test_gpu_memory_must_be_a_finite_positive_number(tmp_path: Path, memory: str) -> None:
    path = _plan(tmp_path / "ok.yaml", TINY)
    code, lines, _ = _run(str(path), f"--gpu-mem={memory}")
    _assert_user_error(code, lines, 1)
    assert lines[0].startswith("error: --gpu-mem: "), lines


def test_every_file_s_errors_at_once(tmp_path: Path) -> None:
    """Two bad files: every problem of both, each naming its file and the key's line."""
    one = _plan(tmp_path / "one.yaml", {**TINY, "hiden_size": 64, "num_attention_heads": 0})
    two = tmp_path / "two.yaml"
    two.write_text("model: {type: qwen3}\nworkload: {tokens: -1}\nparalel: {sp: 2}\n")
    code, lines, _ = _run(str(one), str(two), "--gpus", "8")
    _assert_user_error(code, lines, 4)
    assert sum(line.startswith(f"error: {one}:") for line in lines) == 2, lines
    assert sum(line.startswith(f"error: {two}:") for line in lines) == 2, lines
    assert any("model.config.num_attention_heads" in line for line in lines), lines
    assert any(line.startswith(f"error: {two}:2: workload.tokens") for line in lines), lines


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "eight"],
        ["--gpu-mem"],
        ["--no-such-option"],
        [],
    ],
    ids=["not-a-number", "no-value", "unknown-option", "no-file"],
)
def test_argument_errors_are_one_error_line(tmp_path: Path, args: list[str]) -> None:
    """argparse's usage block (two lines, ``runtime.plan: error:``) becomes the one ``error:`` line of the other
    entry points, with the usage in it."""
    path = _plan(tmp_path / "ok.yaml", TINY)
    code, lines, _ = _run(*([str(path)] if args else []), *args)
    _assert_user_error(code, lines, 1)
    assert "usage: python -m runtime.plan" in lines[0], lines


def test_unreadable_plan_file_has_the_error_prefix(tmp_path: Path) -> None:
    code, lines, _ = _run(str(tmp_path / "missing.yaml"))
    _assert_user_error(code, lines, 1)
    assert str(tmp_path / "missing.yaml") in lines[0], lines


def test_an_unknown_model_type_is_found_before_torch(tmp_path: Path) -> None:
    path = _plan(tmp_path / "type.yaml", TINY, model_type="qwen4")
    code, lines, seconds = _run(str(path))
    _assert_user_error(code, lines, 1)
    assert "model.type" in lines[0] and "qwen4" in lines[0] and "did you mean" in lines[0], lines


def test_layout_search_of_many_gpus_is_quick() -> None:
    """The largest device count allowed, highly composite, for a MoE footprint: the search answers in seconds."""
    from runtime.plan.__main__ import MAX_GPUS
    from runtime.plan.footprint import Footprint
    from runtime.plan.layout import candidates, smallest_fitting

    fp = Footprint(
        name="moe",
        params=30 * 10**9,
        root_params=10**9,
        block_params=(10**8,) * 48,
        block_expert_params=(5 * 10**8,) * 48,
        saved_outside=0,
        saved_blocks=(0,) * 48,
        block_inputs=(0,) * 48,
        peak=10**10,
        peak_checkpointed=10**9,
        tokens=8192,
        heads=32,
        experts=128,
        dtype_bytes=2,
    )
    started = time.monotonic()
    for gpus in {MAX_GPUS, max(n for n in (720720, 55440, 5040) if n <= MAX_GPUS)}:  # many divisors
        found = smallest_fitting(fp, gpus, 80 * 2**30)
        assert found is not None and found[0].gpus == gpus
    assert all(128 % layout.ep == 0 for layout in candidates(fp, 48))
    assert time.monotonic() - started < 20
