"""A run resumed into another ``log.dir`` says where the earlier steps were logged: its metrics.jsonl and plot hold
only its own steps, and the checkpoint records the log directory of the run that wrote it. Resumed into the same
directory, the lineage continues in one metrics.jsonl and nothing is said."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl.test_dpo import dpo_raw


def test_a_resume_into_a_new_log_dir_names_the_earlier_one(
    tiny_pipelines, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    raw = dpo_raw(tiny_pipelines, tmp_path, micro_batch_size=2)  # offline: no rollout, the cheapest run
    first, second = tmp_path / "log-first", tmp_path / "log-second"
    ckpt = tmp_path / "ckpt"
    raw = {**raw, "train": {"steps": 1}, "checkpoint": {"dir": str(ckpt), "interval": 1}}
    run_rl(parse_rl_config({**raw, "log": {**raw["log"], "dir": str(first)}}))
    capsys.readouterr()
    checkpoint = {**raw["checkpoint"], "resume": str(ckpt / "step_000001"), "schedule_change": "continue"}
    resumed = {**raw, "train": {"steps": 2}, "checkpoint": checkpoint}
    result = run_rl(parse_rl_config({**resumed, "log": {**raw["log"], "dir": str(second)}}))
    assert result.start_step == 1
    out = capsys.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if "were logged in" in x]
    assert len(lines) == 1 and f"steps 1-1 were logged in {first.resolve()}" in lines[0], out
    assert f"plot in {second} start at step 2" in lines[0], lines


def test_the_line_is_said_only_when_the_directories_differ(tmp_path: Path) -> None:
    from runtime.rl.run_state import earlier_history

    here = tmp_path / "log"
    assert earlier_history(str(here.resolve()), str(here), 4) is None  # the lineage continues here
    assert earlier_history(None, str(here), 4) is None  # a checkpoint from before the directory was recorded
    line = earlier_history(str(tmp_path / "old"), str(here), 4)
    assert line is not None and "steps 1-4 were logged in" in line and "start at step 5" in line
