"""``python -m bench.gpu_check --dry-run``: the GPU check's every step on tiny sizes on CPU, so the one command a lent
GPU runs is known to work before one is lent. Fails if any step errors; the CUDA-only parts (the ``gpu`` tests, the
measured peak memory) must report skipped with their reason. Under Triton's interpreter (``TRITON_INTERPRET=1``, as
in this session) the MoE step runs the Triton path too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARD = 1200  # a hang guard only (the command's own time on 2 idle cores is ~1 min: docs/performance.md)


def test_dry_run_every_step_ok_or_skipped_with_reason(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=GUARD)
    results = json.loads((tmp_path / "results.json").read_text())
    failed = [f"{s['step']}: {s.get('trace', s.get('error'))}" for s in results["steps"] if s["status"] == "failed"]
    assert not failed, "\n".join(failed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert results["mode"] == "dry-run" and results["size"] == "tiny"
    assert {"torch", "triton", "transformers", "diffusers", "cuda", "device"} <= results["versions"].keys()
    steps = {s["step"].split(" (")[0].split(",")[0]: s for s in results["steps"]}
    assert len(steps) == 6
    tests = steps["cuda tests"]
    assert tests["status"] == "skipped" and "no CUDA device" in tests["reason"]
    assert tests["skipped"] >= 10 and tests["failed"] == tests["passed"] == 0
    assert all("no CUDA device" in t["detail"] for t in tests["tests"])
    assert "measured: skipped" in steps["plan estimate vs measured peak"]["summary"]
    assert all(s["status"] == "ok" for name, s in steps.items() if name != "cuda tests")
    # the table comes last, and results.md holds it
    table = (tmp_path / "results.md").read_text()
    assert done.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])


def test_an_unknown_step_is_refused_in_one_line() -> None:
    """``--only bogus`` ran nothing and exited 0; now exit 2 naming the step and the ones there are."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--only", "pytest", "bogus"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpu_check: --only bogus: no such step; the steps are pytest, measure_dense"), lines
