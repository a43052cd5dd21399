"""``python -m runtime.plan``: what it proposes (the first layout that fits in the order of least recomputation and
communication, not of memory, and the runners-up with their memory), dotted overrides as ``runtime.train`` takes
them, progress lines on stderr when asked. The choice is checked on a hand-built footprint and candidate list (pure
arithmetic, no torch); one tiny plan is measured end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runtime.plan.__main__ import main
from runtime.plan.choice import choice_lines
from runtime.plan.config import read_plan
from runtime.plan.footprint import Footprint
from runtime.plan.layout import USABLE, Layout, candidates, fitting, per_rank, smallest_fitting
from tests.plan_configs import TINY_QWEN3

GIB = 2**30
# a Wan2.1-14B-like footprint: its activations without checkpointing need sp 8 to fit 80 GiB, with it sp 1 does
FP = Footprint(
    name="dit",
    params=14 * 10**9,
    root_params=10**8,
    block_params=(3 * 10**8,) * 40,
    block_expert_params=(0,) * 40,
    saved_outside=0,
    saved_blocks=(0,) * 40,
    block_inputs=(0,) * 40,
    peak=int(520 * GIB),
    peak_checkpointed=int(28 * GIB),
    tokens=32760,
    heads=40,
    experts=0,
    dtype_bytes=2,
)


def _row(memory) -> str:
    return f"total {memory.total / GIB:.1f} GiB"


def test_the_choice_is_the_first_fit_in_order_and_the_runners_up_carry_their_memory() -> None:
    configured = Layout(1, 64, sp=1, activation_checkpointing=True)
    hand = [
        Layout(8, 8, sp=1),  # no checkpointing, sp 1: 520 GiB of activations, does not fit
        Layout(1, 8, sp=8),  # 65 GiB of activations: the first that fits
        configured,  # checkpointed: a fraction of the memory, after it in the order
        Layout(2, 32, sp=1, activation_checkpointing=True),
        Layout(4, 16, sp=1, activation_checkpointing=True),
        Layout(8, 8, sp=1, activation_checkpointing=True),
    ]
    fits = fitting(FP, hand, 80 * GIB, count=4)
    assert [layout for layout, _ in fits] == hand[1:5]  # the order kept, the misfit left out, at most 4
    assert all(memory.total <= USABLE * 80 * GIB for _, memory in fits)
    proposal, runner_up = fits[0][1].total, fits[1][1].total
    assert proposal > 2 * runner_up  # the proposal is not the least memory: the configured layout needs far less
    lines = choice_lines(fits, configured, _row)
    text = "\n".join(lines)
    assert "first layout that fits" in text and "not the least memory" in text and "smallest that fits" not in text
    assert "dp_replicate 1 x dp_shard 8 x sp 8" in lines[1] and f"total {proposal / GIB:.1f} GiB" in text
    header = next(i for i, line in enumerate(lines) if line.startswith("    runners-up"))
    runners = lines[header + 1 :]
    assert len(runners) == 3 and "(the configured layout)" in runners[0]
    assert runners[0].endswith(f": {runner_up / GIB:.1f} GiB"), runners
    (none,) = choice_lines([], configured, _row)
    assert none == "    first layout that fits: none (more GPUs, or a shorter micro-batch)"


def test_the_search_proposes_the_first_fitting_candidate() -> None:
    """``smallest_fitting`` (the proposal) is the head of ``fitting`` over every candidate; at 64 GPUs x 80 GiB the
    configured checkpointed layout is among the candidates and fits, at less memory than the proposal."""
    found = fitting(FP, candidates(FP, 64), 80 * GIB)
    assert smallest_fitting(FP, 64, 80 * GIB) == found[0]
    configured = Layout(1, 64, sp=1, activation_checkpointing=True)
    assert configured in [layout for layout, _ in found]
    assert per_rank(FP, configured).total < found[0][1].total


def _plan_file(tmp_path: Path, **workload) -> Path:
    path = tmp_path / "plan.yaml"
    raw = {"model": {"type": "qwen3", "config": TINY_QWEN3}, "workload": {"tokens": 64, **workload}}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_overrides_set_keys_of_the_plan_file(tmp_path: Path) -> None:
    from runtime.config.overrides import parse_overrides

    path = _plan_file(tmp_path)
    plan = read_plan(path, parse_overrides(["--parallel.sp=2", "--workload.tokens", "128"]))
    assert plan.parallel.sp == 2 and plan.workload.tokens == 128
    assert read_plan(path).parallel.sp == 1 and read_plan(path).workload.tokens == 64


def test_a_plan_with_overrides_runs_and_reports_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _plan_file(tmp_path)
    assert main([str(path), "--gpus", "4", "--parallel.sp", "2", "--workload.tokens=128", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "128 tokens per micro-batch" in out, out
    assert "configured: dp_replicate 1 x dp_shard 2 x sp 2" in out, out
    assert "first layout that fits" in out and "runners-up" in out, out
    stages = [line for line in err.splitlines() if line.startswith(f"plan: {path}: ")]
    assert len(stages) >= 4 and any("activation checkpointing on" in line for line in stages), err
    assert all(line.startswith("plan: ") for line in err.splitlines()), err  # nothing else on stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--parallel.sp=0"], "override --parallel.sp: must be positive"),
        (["--parallel.spp=2"], "override --parallel.spp: unknown key"),
        (["--workload.tokens", "lots"], "override --workload.tokens: expected int"),
        (["--workload.tokens"], "override --workload.tokens: expected a value"),
        (["parallel.sp=2"], "an override is written --parallel.sp=2"),
        (["--parallel.sp=[1"], "not a YAML value"),
    ],
)
def test_a_bad_override_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    import sys

    torch_before = "torch" in sys.modules
    assert main([str(_plan_file(tmp_path)), *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert "Traceback" not in err and not out
    assert torch_before or "torch" not in sys.modules  # refused before the model is built
