"""Hostile configs of ``python -m runtime.rl`` (round 5), on a tiny two-expert Wan2.2 A14B pipeline.

Rules checked here: with launcher options every check that needs no rank runs in the launcher, before any rank
starts, each error one line and all of them at once (a two-expert pipeline without ``dit.condition.expert``, a
missing prompts file with the near namesake its folder holds, a height the model's pixel multiple does not divide);
the ranks agree on the refusals they find, so rank 0 prints them, even one only another rank found; a
non-numeric ``boundary_ratio``, a ``rollout_is_threshold`` below 1 and a DiffusionOPD teacher that is the student's
own directory are one line each (exit 2); a reward raising ``KeyboardInterrupt`` is one line and exit code 130.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.rl.common import rl_config


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.tiny import save_wan_a14b

    return save_wan_a14b(tmp_path_factory.mktemp("a14b") / "a14b")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr("runtime.cli.launch", refuse)


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _main(argv: list[str]) -> tuple[int, list[str]]:
    from runtime.rl.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert not any("Traceback" in line for line in lines), lines
    return code, lines


def _expert(a14b: Path, tmp_path: Path, **sections) -> dict:
    return rl_config("wan", a14b, tmp_path, dit={"condition": {"expert": "transformer_2"}}, **sections)


def test_launcher_refuses_a_missing_expert_before_any_rank(a14b: Path, tmp_path: Path, no_launch) -> None:
    config = _write(tmp_path, rl_config("wan", a14b, tmp_path))
    code, lines = _main(["--nproc-per-node", "2", str(config)])
    assert code == 2 and len(lines) == 1, lines
    assert "dit.condition.expert: " in lines[0] and "'transformer_2' (low noise)" in lines[0], lines


def test_launcher_reports_every_input_error_at_once(a14b: Path, tmp_path: Path, no_launch) -> None:
    raw = _expert(a14b, tmp_path, sampling={"height": 40, "width": 36})
    prompts = Path(raw["data"]["prompts"])
    raw["data"]["prompts"] = str(prompts.with_name("prompt6.txt"))  # a typo of the file that is there
    code, lines = _main(["--nproc-per-node", "2", str(_write(tmp_path, raw))])
    assert code == 2 and len(lines) == 3, lines
    assert f"data.prompts: {prompts.with_name('prompt6.txt')}: no such file; did you mean {prompts}?" in lines[0]
    assert "sampling.height: 40 is not a multiple of 16" in lines[1], lines
    assert "sampling.width: 36 is not a multiple of 16" in lines[2], lines


def _refusal_on_rank_one(rank: int, world_size: int, raw: dict, missing: str) -> list[str]:
    """``check_rl_inputs`` where only rank 1 reads a missing prompts file: the messages each rank raises."""
    import dataclasses

    from runtime.rl.config import parse_rl_config
    from runtime.rl.preflight import RefusedOnEveryRank, check_rl_inputs
    from runtime.train.loop import setup_parallel

    config = parse_rl_config(raw)
    if rank == 1:
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, prompts=missing))
    state = setup_parallel(config)
    try:
        check_rl_inputs(config, state)
    except RefusedOnEveryRank as exc:
        return exc.messages
    return []


@pytest.mark.dist
def test_ranks_agree_so_rank_zero_says_what_another_rank_found(a14b: Path, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed

    missing = str(tmp_path / "gone.txt")
    messages = run_distributed(_refusal_on_rank_one, 2, _expert(a14b, tmp_path), missing, timeout=120)
    assert messages[0] == messages[1] == [f"data.prompts: {missing}: no such file"], messages


def test_an_agreed_refusal_is_silent_on_other_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, rank 1 leaves an agreed refusal to rank 0: no line, exit code 2 (after its wait)."""
    from runtime.rl import __main__ as rl_main
    from runtime.rl.preflight import RefusedOnEveryRank

    def refused(config) -> None:
        raise RefusedOnEveryRank("data.prompts: x.txt: no such file")

    monkeypatch.setattr("runtime.rl.loop.run_rl", refused)
    monkeypatch.setattr(rl_main, "QUIET_RANK_WAIT", 0.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        rl_main.run(None)
    assert exit_.value.code == 2
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RefusedOnEveryRank):  # rank 0 prints it (run_command)
        rl_main.run(None)


def test_non_numeric_boundary_ratio_is_one_line(a14b: Path, tmp_path: Path, no_launch) -> None:
    pipeline = tmp_path / "bad"
    shutil.copytree(a14b, pipeline)
    index = json.loads((pipeline / "model_index.json").read_text())
    (pipeline / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": "high"}))
    code, lines = _main(["--nproc-per-node", "2", str(_write(tmp_path, _expert(pipeline, tmp_path)))])
    assert code == 2 and len(lines) == 1, lines
    assert f"model.path: {pipeline}/model_index.json: boundary_ratio 'high' is not a number in (0, 1)" in lines[0]


@pytest.mark.parametrize("threshold", [1e-300, 0.5])
def test_rollout_is_threshold_below_one_is_one_line(a14b: Path, tmp_path: Path, threshold: float) -> None:
    raw = _expert(a14b, tmp_path, rollout_correction={"rollout_is": "token", "rollout_is_threshold": threshold})
    code, lines = _main([str(_write(tmp_path, raw))])
    assert code == 2 and len(lines) == 1, lines
    assert "rollout_correction.rollout_is_threshold: expected a number >= 1" in lines[0], lines


def test_tis_threshold_of_one_still_runs_the_weights() -> None:
    """The smallest threshold kept: 1 (min(ratio, 1)) computes finite weights and metrics."""
    import torch

    from runtime.rl.correction_config import RolloutCorrectionConfig
    from runtime.rl.rollout_correction import correction

    old = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    weights, metrics = correction(old, old + 0.1, RolloutCorrectionConfig("token", 1.0))
    assert bool((weights <= 1).all()) and all(v == v for v in metrics.values())


def test_teacher_that_is_the_student_is_refused(a14b: Path, tmp_path: Path, no_launch) -> None:
    raw = _expert(a14b, tmp_path)
    raw["algorithm"] = "diffusionopd"  # the same directory, spelled otherwise
    raw["diffusionopd"] = {**raw.pop("flowgrpo"), "teacher_model_path": f"{a14b}/../{a14b.name}/"}
    code, lines = _main(["--nproc-per-node", "2", str(_write(tmp_path, raw))])
    assert code == 2 and len(lines) == 1, lines
    assert "diffusionopd.teacher_model_path: " in lines[0] and "is model.path" in lines[0], lines


def test_teacher_elsewhere_is_not_refused(a14b: Path, tmp_path: Path) -> None:
    from runtime.rl.config import parse_rl_config
    from runtime.rl.preflight import check_teacher

    other = tmp_path / "teacher"
    shutil.copytree(a14b, other)
    raw = _expert(a14b, tmp_path)
    raw["algorithm"] = "diffusionopd"
    raw["diffusionopd"] = {**raw.pop("flowgrpo"), "teacher_model_path": str(other)}
    check_teacher(parse_rl_config(raw))


class InterruptedWhenBuilt:
    """A class reward whose constructor raises KeyboardInterrupt (a user's script that ends itself so)."""

    def __init__(self) -> None:
        raise KeyboardInterrupt

    def __call__(self, samples, prompts) -> list[float]:  # pragma: no cover
        return [0.0] * len(prompts)


def interrupts(samples, prompts) -> list[float]:
    raise KeyboardInterrupt


def test_reward_keyboard_interrupt_is_one_line_exit_130(a14b: Path, tmp_path: Path) -> None:
    raw = _expert(a14b, tmp_path, rewards=[{"callable": f"{__name__}:InterruptedWhenBuilt"}])
    try:
        code, lines = _main([str(_write(tmp_path, raw))])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt left runtime.rl (a traceback)")
    assert code == 130 and lines == ["error: interrupted"], (code, lines)


def test_reward_called_names_itself_in_the_interrupt() -> None:
    import torch

    from runtime.rl.rewards import build_rewards

    mix = build_rewards([{"callable": f"{__name__}:interrupts", "name": "judge"}])
    with pytest.raises(KeyboardInterrupt, match=r"^reward 'judge' raised KeyboardInterrupt$"):
        mix.rewards[0](torch.zeros(1, 3, 8, 8), ["a red kite"])
