"""Hostile inputs for the trainer and its companions (round 5): a plan whose micro-batch overflows torch's sizes.

Rule: a user error is one ``error:`` line naming the file (and key) and exit code 2, in seconds, no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}

TINY_QWEN3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


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
    path.write_text(
        yaml.safe_dump({"model": {"type": "qwen3", "config": TINY_QWEN3}, "workload": {"tokens": 10**11}})
    )
    code, lines = _module("runtime.plan", str(path), "--gpus", "1")
    assert code == 2 and len(lines) == 1, (code, lines[:3])
    assert lines[0].startswith(f"error: {path}: model: "), lines
