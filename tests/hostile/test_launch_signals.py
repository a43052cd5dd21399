"""Signals to the launcher of a 2-rank run (``python -m runtime.train --nproc-per-node 2``): the ranks live and die
with it. SIGKILL (which it cannot pass on) ends the ranks within seconds and no checkpoint follows; SIGTERM and SIGINT
stop the ranks and end the launcher with one line and the shell's exit code (143, 130), its checkpoints intact.

Before the fixes the ranks trained and checkpointed on alone after a SIGKILL, and SIGTERM/SIGINT ended with torch's
``SignalException`` traceback (exit 1) and a ``KeyboardInterrupt`` traceback per rank. Each case is a real tiny
2-rank job (CPU, gloo), signalled once its first checkpoint is written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from runtime.checkpoint import COMPLETE_MARKER
from runtime.launcher_signals import stopped_line
from tests.train.common import run_config

ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE = 300  # seconds to the first checkpoint (three torch imports on a loaded 2-core machine: 30-50 s)
GONE_WITHIN = 5.0  # seconds the ranks may outlive a killed launcher


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path, list[psutil.Process]]:
    """A 2-rank job of many steps that checkpoints every step, once its first checkpoint is there: (the launcher,
    the checkpoint directory, its rank processes)."""
    checkpoints = tmp_path / "ckpt"
    raw = run_config(
        tmp_path, train={"steps": 1000}, checkpoint={"dir": str(checkpoints), "interval": 1, "save_total_limit": 1000}
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "runtime.train", "--nproc-per-node", "2", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + START_DEADLINE
    while not list(checkpoints.glob(f"step_*/{COMPLETE_MARKER}")):
        if launcher.poll() is not None:
            pytest.fail(f"the job ended before its first checkpoint: {launcher.returncode} {launcher.stderr.read()}")
        if time.monotonic() > deadline:
            _stop([launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))])
            pytest.fail(f"no checkpoint after {START_DEADLINE} s")
        time.sleep(0.2)
    ranks = psutil.Process(launcher.pid).children()
    assert len(ranks) == 2, ranks
    return launcher, checkpoints, ranks


def _stop(pids: list[int]) -> None:
    """SIGKILL what a failed case left running (only the processes this test started)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ranks_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    launcher, checkpoints, ranks = _start(tmp_path)
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=GONE_WITHIN)
        assert not alive, f"rank(s) {[p.pid for p in alive]} still running {GONE_WITHIN} s after the launcher died"
        written = sorted(p.name for p in checkpoints.glob("step_*"))
        time.sleep(2.0)
        assert sorted(p.name for p in checkpoints.glob("step_*")) == written, "a checkpoint after the launcher died"
    finally:
        _stop([p.pid for p in ranks])
        launcher.stderr.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_launcher_stops_in_one_line(tmp_path: Path, sig: signal.Signals) -> None:
    from runtime.checkpoint.verify import verify_checkpoint

    launcher, checkpoints, ranks = _start(tmp_path)
    try:
        os.kill(launcher.pid, sig)
        _, err = launcher.communicate(timeout=120)
        _, alive = psutil.wait_procs(ranks, timeout=GONE_WITHIN)
    finally:
        _stop([launcher.pid, *(p.pid for p in ranks)])
    assert launcher.returncode == 128 + sig, (launcher.returncode, err[-3000:])
    assert err.strip().splitlines() == [stopped_line(sig)], err[-3000:]
    assert not alive
    complete = [p.parent for p in checkpoints.glob(f"step_*/{COMPLETE_MARKER}")]
    assert complete and all(verify_checkpoint(p) for p in complete)
