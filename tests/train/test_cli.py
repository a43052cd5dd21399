"""The command line of the run entry points as a user meets it (issue 21 A, E): ``--help`` and a bad config answered
in under 2 s without importing torch, dotted overrides checked like file values, every config error at once, the
launcher (``python -m runtime.train --nproc-per-node 2 cfg.yaml``) and plain torchrun saying a config error once,
and a resume under a changed learning-rate schedule refused.

Times are wall-clock times of a fresh interpreter (``python -m ...``), measured on the shared 2-core test machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.train.common import run_config

ROOT = Path(__file__).resolve().parents[2]
# seconds: --help and a bad config, interpreter start included. What makes them fast is structural and asserted in
# _probe (torch is never imported); the wall-clock bound only catches a pathological slowdown, so it is generous:
# measured 0.6 s on a quiet 2-core machine and 1.5-2.5 s at load average 10-26 (a 2 s bound failed there).
FAST = 10.0
ENTRY_POINTS = ["runtime.train", "runtime.train.prepare", "runtime.rl", "runtime.demo"]

# Runs ``python -m <module> <args>`` in this interpreter (runpy, as -m does) and reports the exit code and whether
# any torch module was imported.
_PROBE = """
import runpy, sys
module, args = sys.argv[1], sys.argv[2:]
sys.argv = [module, *args]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
torch = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
print(f"PROBE {code} torch={len(torch)}", file=sys.stderr)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _probe(module: str, *args: str) -> tuple[int, str, list[str], float]:
    """(exit code, stdout, stderr lines without the probe's, wall seconds); asserts torch was not imported."""
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, module, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    elapsed = time.perf_counter() - started
    lines = run.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("PROBE "), run.stderr
    code, torch = lines[-1].split()[1:]
    assert torch == "torch=0", f"{module} {args} imported torch"
    return int(code), run.stdout, lines[:-1], elapsed


def _main(argv: list[str]) -> tuple[int, list[str]]:
    """``python -m runtime.train argv`` in this process: exit code and stderr lines."""
    import torch

    from runtime.parallel.state import set_parallel_state
    from runtime.train.__main__ import main

    err = io.StringIO()
    with torch.random.fork_rng(devices=[]), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        finally:
            set_parallel_state(None)
    return code, err.getvalue().strip().splitlines()


def _write(path: Path, raw: dict | str) -> Path:
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return path


def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------------------- --help


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_answers_without_torch(module: str) -> None:
    code, out, err, elapsed = _probe(module, "--help")
    assert code == 0 and not err, err
    assert out.startswith("usage: python -m " + module), out[:200]
    assert elapsed < FAST, f"{module} --help took {elapsed:.2f} s"


def test_help_holds_the_config_reference_and_the_command_line() -> None:
    _, out, _, _ = _probe("runtime.train", "--help")
    for needle in ("--section.key=VALUE", "--nproc-per-node", "max_grad_norm", "lr_scheduler_type", "report_to"):
        assert needle in out, needle
    _, out, _, _ = _probe("runtime.train.prepare", "-h")
    assert "data.cache" in out and "cache: null" in out
    _, out, _, _ = _probe("runtime.rl", "cfg.yaml", "--help")  # --help anywhere
    assert "algorithm: flowgrpo" in out and "advantage_std_ddof" in out


def test_demo_help_does_not_start_the_demo() -> None:
    code, out, err, elapsed = _probe("runtime.demo", "--help")
    assert code == 0 and "== 1." not in out and "regenerate" in out, out
    assert elapsed < FAST
    code, out, err, _ = _probe("runtime.demo", "--fast")
    assert code == 2 and "== 1." not in out and len(err) == 1 and "takes no arguments" in err[0], err


# --------------------------------------------------------------------------------------------- every error at once

THREE_ERRORS = """\
model:
  type: qwen3
  config:
    hiden_size: 64
data:
  path: data.jsonl
  tokenizer: tok
optim:
  lr: .inf
log:
  tensorbord: true
"""


@pytest.mark.parametrize("module", ["runtime.train", "runtime.train.prepare"])
def test_three_errors_are_listed_at_once_without_torch(module: str, tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", THREE_ERRORS)
    code, _, err, elapsed = _probe(module, str(path))
    assert code == 2, err
    assert err == [
        f"error: {path}:4: model.config.hiden_size: unknown key for Qwen3Config; did you mean 'hidden_size'?",
        f"error: {path}:9: optim.lr: must be a finite number, found inf",
        f"error: {path}:11: log.tensorbord: unknown key; did you mean log.tensorboard, now log.report_to (a list: "
        "[tensorboard])? (expected one of dir, interval, report_to, project, run_name, peak_tflops, progress)",
    ], err
    assert elapsed < FAST, f"{elapsed:.2f} s"


def test_rl_config_errors_are_listed_at_once_without_torch(tmp_path: Path) -> None:
    raw = {
        "algorithm": "flowgrpo",
        "model": {"type": "flux", "path": "pipe"},
        "data": {"prompts": "p.txt", "prompts_per_step": 0},
        "sampling": {"height": 64, "width": 64, "true_cfg_scale": 0.5},
        "rewards": [{"callable": "m:f"}, {"clip": str(tmp_path / "no-clip")}],
        "optim": {"lrr": 1.0},
        "flowgrpo": {"group_size": 1, "window_size": 11},
    }
    path = _write(tmp_path / "rl.yaml", raw)
    code, _, err, elapsed = _probe("runtime.rl", str(path))
    assert code == 2 and len(err) == 6, err
    assert [line.split(": ")[2] for line in err] == [  # in the order of their lines in the file
        "data.prompts_per_step",
        "sampling.true_cfg_scale",
        "rewards[1].clip",
        "optim.lrr",
        "flowgrpo.group_size",
        "flowgrpo.window_size",
    ], err
    assert "did you mean optim.lr?" in err[3]
    assert elapsed < FAST


def test_yaml_exponent_floats_read_as_numbers(tmp_path: Path) -> None:
    """``lr: 1e-4`` is a float (YAML 1.2); PyYAML's YAML 1.1 default reads it as the string '1e-4'."""
    from runtime.train.config import load_run_config

    text = yaml.safe_dump(run_config(tmp_path)).replace("lr: 0.003", "lr: 1e-4")
    assert "lr: 1e-4" in text
    assert load_run_config(_write(tmp_path / "run.yaml", text)).optim.lr == 1e-4


# --------------------------------------------------------------------------------------------------- overrides

OVERRIDE_ERRORS = [
    (["--train.steps=0"], "override --train.steps: must be positive, found 0"),
    (["--optim.lr", ".nan"], "override --optim.lr: must be a finite number, found nan"),
    (["--optim.lr=fast"], "override --optim.lr: expected float, found str 'fast'"),
    (["--optim.lrr=1e-4"], "override --optim.lrr: unknown key; did you mean optim.lr?"),
    (["--model.config.hiden_size=8"], "override --model.config.hiden_size: unknown key for Qwen3Config; did you mean"),
    (["--log.report_to=[tensorbord]"], "override --log.report_to: log.report_to[0]: unknown value 'tensorbord'"),
    (["--optim.grad_clip=1"], "override --optim.grad_clip: renamed to optim.max_grad_norm"),
    (["--optim.lr.value=1"], "override --optim.lr.value: optim.lr is a float, not a section"),
]


@pytest.mark.parametrize(("args", "message"), OVERRIDE_ERRORS, ids=[a[0] for a, _ in OVERRIDE_ERRORS])
def test_overrides_are_checked_like_file_values(args: list[str], message: str, tmp_path: Path) -> None:
    path = _write(tmp_path / "run.yaml", run_config(tmp_path))
    code, err = _main([str(path), *args])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + message), err


def test_override_errors_come_with_the_file_errors(tmp_path: Path) -> None:
    raw = run_config(tmp_path, optim={"lr": float("inf")})
    path = _write(tmp_path / "run.yaml", raw)
    code, err = _main([str(path), "--train.steps", "-1"])
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("lr:"))
    assert code == 2 and err == [
        f"error: {path}:{line}: optim.lr: must be a finite number, found inf",
        "error: override --train.steps: must be positive, found -1",
    ], err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["train.steps=3"], "expected an override --section.key=value"),
        (["--train.steps"], "expected a value"),
        (["--train..steps=3"], "names a dotted key"),
        (["--optim.betas=[0.9"], "not a YAML value"),
    ],
)
def test_malformed_overrides_are_usage_errors(args: list[str], words: str, tmp_path: Path) -> None:
    path = _write(tmp_path / "run.yaml", run_config(tmp_path))
    code, err = _main([str(path), *args])
    assert code == 2 and len(err) == 1 and words in err[0] and "usage: python -m runtime.train" in err[0], err


def test_an_override_changes_the_run_as_the_same_value_in_the_file(tmp_path: Path) -> None:
    """``--train.steps=2 --optim.lr 1e-3`` over a file asking for 5 steps at 3e-3 trains exactly as a file saying
    2 steps at 1e-3."""
    by_override = _write(
        tmp_path / "a.yaml", run_config(tmp_path, log={"dir": str(tmp_path / "a"), "progress": False})
    )
    code, err = _main([str(by_override), "--train.steps=2", "--optim.lr", "1e-3"])
    assert code == 0, err
    in_file = run_config(tmp_path, log={"dir": str(tmp_path / "b"), "progress": False})
    in_file["train"]["steps"], in_file["optim"]["lr"] = 2, 1e-3
    code, err = _main([str(_write(tmp_path / "b.yaml", in_file))])
    assert code == 0, err
    overridden, reference = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [m["step"] for m in overridden] == [1, 2]
    assert [(m["loss"], m["lr"]) for m in overridden] == [(m["loss"], m["lr"]) for m in reference]


# ------------------------------------------------------------------------------------------ launcher and torchrun


def test_launcher_flags_are_torchruns() -> None:
    """The launcher options that take no value, listed so that the command line parses without importing torch,
    are torchrun's own (minus those naming what to run, which the command sets)."""
    from torch.distributed.run import get_args_parser

    from runtime.cli import _NOT_LAUNCHER, LAUNCHER_FLAGS

    flags = {
        option
        for action in get_args_parser()._actions
        if action.nargs == 0 and action.dest != "help"
        for option in action.option_strings
    }
    assert flags - set(_NOT_LAUNCHER) == set(LAUNCHER_FLAGS)


def test_launcher_with_a_bad_config_starts_no_rank(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", run_config(tmp_path, train={"steps": 0}))
    code, _, err, elapsed = _probe("runtime.train", "--nproc-per-node", "2", str(path))
    assert code == 2 and len(err) == 1 and "train.steps: must be positive, found 0" in err[0], err
    assert elapsed < FAST, f"{elapsed:.2f} s"
    code, _, err, _ = _probe("runtime.rl", "--nproc-per-node=2", "--standalone", str(path))
    assert code == 2 and len(err) == 1 and "algorithm: required key missing" in err[0], err
    code, _, err, _ = _probe("runtime.train", "--nproc-per-node", "2", "-m", str(path))
    assert code == 2 and len(err) == 1 and "-m: the command sets what the ranks run" in err[0], err


@pytest.mark.parametrize("module", ["runtime.train", "runtime.rl"])
def test_a_layout_the_processes_cannot_hold_is_refused_before_any_rank(module: str, tmp_path: Path) -> None:
    """``parallel.sp: 2`` in one process, or on the 3 processes the launcher options would start, is one line naming
    ``parallel`` and the command line that runs it, in seconds, before torch is imported or a rank started."""
    if module == "runtime.rl":
        from tests.rl.common import rl_config

        raw = rl_config("flux", tmp_path / "pipeline", tmp_path, parallel={"sp": 2})
    else:
        raw = run_config(tmp_path, parallel={"sp": 2}, train={"steps": 1})
    path = _write(tmp_path / "run.yaml", raw)
    code, _, err, elapsed = _probe(module, str(path), "--train.steps=1")
    line = _line(path, "parallel")
    assert code == 2 and err == [
        f"error: {path}:{line}: parallel: dp_replicate 1 x dp_shard auto x sp 2 (ep 1) needs 2 processes and this "
        f"command runs one; launch them: python -m {module} --nproc-per-node 2 {path} --train.steps=1"
    ], err
    assert elapsed < FAST, f"{elapsed:.2f} s"
    code, _, err, elapsed = _probe(module, "--nproc-per-node", "3", str(path))
    assert code == 2 and len(err) == 1 and "does not tile the 3 processes the launcher options start" in err[0], err
    assert f"2 would: python -m {module} --nproc-per-node 2 {path}" in err[0] and elapsed < FAST, err


def test_the_start_up_summary_is_the_first_thing_printed(tmp_path: Path, capsys) -> None:
    """Before the inputs are checked or the model built, rank 0 says what runs where; then what is loading; once the
    model is built, its size; then the steps."""
    import torch

    from runtime.parallel.state import set_parallel_state
    from runtime.train.__main__ import main

    raw = run_config(tmp_path, train={"steps": 1}, checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 1})
    path = _write(tmp_path / "run.yaml", raw)
    with torch.random.fork_rng(devices=[]):
        try:
            assert main([str(path)]) == 0
        finally:
            set_parallel_state(None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"run: qwen3 (random init) on {raw['data']['path']} | 1 process(es) = "), lines
    for words in ("compute float32 (train.mixed_precision auto)", "1 steps", f"logs {raw['log']['dir']}"):
        assert words in lines[0], (words, lines[0])
    assert f"checkpoints {tmp_path / 'ckpt'} every 1 steps, export none" in lines[0], lines[0]
    assert lines[1].startswith("checking the inputs") and lines[2].startswith("building the model"), lines
    assert re.match(r"model: [\d,]+ parameters, [\d,]+ trained \| data: \d+ samples$", lines[3]), lines
    assert any("step" in line and "loss" in line for line in lines[4:]), lines


def test_launched_processes_reads_torchruns_counts() -> None:
    from runtime.cli import launched_processes

    assert launched_processes(["--nproc-per-node", "2", "--nnodes", "2"]) == 4
    assert launched_processes(["--nproc_per_node=3", "--standalone"]) == 3
    assert launched_processes(["--standalone"]) == 1  # torchrun's defaults: one process on one node
    assert launched_processes(["--nproc-per-node", "gpu"]) is None  # torchrun counts them: the ranks check it
    assert launched_processes(["--nproc-per-node", "2", "--nnodes", "1:2"]) is None  # elastic


@pytest.mark.dist
def test_plain_torchrun_prints_a_config_error_once(tmp_path: Path) -> None:
    """Every rank finds the error and exits 2; rank 0 prints it. torchrun itself then adds its ChildFailedError
    report (a traceback and a failure summary) and exits 1: that part is torchrun's (docs/training.md)."""
    path = _write(tmp_path / "bad.yaml", run_config(tmp_path, train={"steps": 0}))
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "-m", "runtime.train", str(path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ours = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [f"error: {path}:{_line(path, 'steps')}: train.steps: must be positive, found 0"], run.stderr
    assert run.returncode == 1 and "ChildFailedError" in run.stderr and "exitcode  : 2" in run.stderr
    assert f'File "{ROOT / "runtime"}' not in run.stderr  # the traceback is torchrun's, no frame is ours


def _line(path: Path, key: str) -> int:
    return next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith(f"{key}:"))


@pytest.mark.dist
def test_launcher_trains_a_good_config_on_two_ranks(tmp_path: Path) -> None:
    path = _write(tmp_path / "run.yaml", run_config(tmp_path))
    run = subprocess.run(
        [sys.executable, "-m", "runtime.train", "--nproc-per-node", "2", str(path), "--train.steps=2"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "error" not in run.stderr.lower(), run.stderr[-3000:]
    metrics = _metrics(tmp_path / "log")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] > 0 for m in metrics)


@pytest.mark.dist
def test_launcher_says_a_failed_rank_in_one_line_with_its_exit_code() -> None:
    code = (
        "import sys; from runtime.cli import launch; "
        "sys.exit(launch('tests.train.rank_exit', ['--nproc-per-node', '2'], ['3']))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 3, run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: rank 1 exited with code 3 (its output is above); the launcher stopped the other 1 rank(s)"
    ], run.stderr


# ------------------------------------------------------------------------------------------------------- resume


def test_resume_under_a_changed_schedule_is_refused(tmp_path: Path) -> None:
    """Four steps with checkpoints at 2 and 4. Resuming with more steps, or another lr, is one line naming the key
    and both values (exit 2); resuming step 2 with the same schedule reproduces steps 3-4 bitwise; resuming with
    train.steps at the checkpoint's step trains nothing (how a checkpoint's weights are exported)."""
    ckpt = tmp_path / "ckpt"

    def config(name: str, **sections) -> Path:
        raw = run_config(
            tmp_path,
            train={"steps": 4},
            checkpoint={"dir": str(ckpt), "interval": 2},
            log={"dir": str(tmp_path / name), "progress": False},
        )
        for section, values in sections.items():
            raw[section] = {**raw[section], **values}
        return _write(tmp_path / f"{name}.yaml", raw)

    code, err = _main([str(config("straight"))])
    assert code == 0, err
    straight = _metrics(tmp_path / "straight")

    path = config("more")
    code, err = _main([str(path), "--train.steps=6"])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: override --train.steps: 6 here, 4 in checkpoint {ckpt / 'step_000004'}"), err
    # step 5 trains at the same rate either way (half-way through both decays, the saved one held past its end)
    assert "step 6 would train at lr" in err[0] and "checkpoint.schedule_change: continue" in err[0], err
    assert "or train.steps: 4" in err[0], err

    step2 = str(ckpt / "step_000002")
    path = config("lr", optim={"lr": 1e-3}, checkpoint={"resume": step2})
    code, err = _main([str(path)])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {path}:{_line(path, 'lr')}: optim.lr: 0.001 here, 0.003 in checkpoint"), err
    assert "step 3 would train at lr" in err[0], err

    code, err = _main([str(config("resumed", checkpoint={"resume": step2}))])
    assert code == 0, err
    resumed = _metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for got, ref in zip(resumed, straight[2:], strict=True):
        assert (got["loss"], got["grad_norm"], got["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"])

    code, err = _main([str(config("export-only", train={"steps": 2}, checkpoint={"resume": step2}))])
    assert code == 0, err

    # under the launcher the same error is one line, before any rank starts (the launcher reads the checkpoint's
    # recorded schedule itself); the bound is generous (torch is imported: 2-5 s on a loaded 2-core machine)
    path = config("launched")
    run = _launch(path, "--train.steps=6")
    assert (
        run.returncode == 2
        and run.stderr.strip().splitlines()
        == [
            line
            for line in run.stderr.strip().splitlines()
            if line.startswith("error: override --train.steps: 6 here")
        ]
        != []
    ), run.stderr


def _launch(path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m runtime.train --nproc-per-node 2 path overrides`` with torchrun's start-up warning silenced (it
    is printed when OMP_NUM_THREADS is unset; _env sets it)."""
    command = [sys.executable, "-m", "runtime.train", "--nproc-per-node", "2", str(path), *overrides]
    return subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def test_launcher_checks_paths_and_the_export_dir_before_any_rank(tmp_path: Path) -> None:
    """Errors that need no rank are the launcher's: one line, once, in seconds (they took 70-110 s and came once
    per rank when the ranks found them)."""
    export = tmp_path / "hf"
    export.mkdir()
    (export / "notes.txt").write_text("keep me")
    path = _write(tmp_path / "run.yaml", run_config(tmp_path, export={"dir": str(export)}, train={"steps": 1}))
    run = _launch(path)  # refused by the launcher: one line, once, and no rank ran (no log directory below)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, lines
    assert "export.dir" in lines[0] and "not an earlier export" in lines[0], lines
    assert (export / "notes.txt").read_text() == "keep me" and not (tmp_path / "log").exists()
    path = _write(tmp_path / "resume.yaml", run_config(tmp_path, checkpoint={"resume": str(tmp_path / "nowhere")}))
    lines = _launch(path).stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:") and "checkpoint.resume" in lines[0], lines


def test_a_finished_run_extends_with_its_optimizer_and_data_state(tmp_path: Path) -> None:
    """Four steps, then train.steps raised to 8 and resumed from step 4. With a constant rate the resumed steps 5-8
    equal an uninterrupted 8-step run bitwise (AdamW's moments and the data position are the saved ones). With a
    cosine schedule, `continue` trains steps 5-8 at the saved curve's last rate, `replan` at the 8-step schedule's
    rates of steps 5-8; the log says which, and the refused default names both."""

    def run(name: str, steps: int, optim: dict, resume: Path | None = None, mode: str | None = None) -> list[dict]:
        ckpt = {"dir": str(tmp_path / f"ckpt-{name}"), "interval": 4}
        if resume is not None:
            ckpt = {"dir": str(resume.parent), "interval": 0, "resume": str(resume)}
        if mode is not None:
            ckpt["schedule_change"] = mode
        raw = run_config(
            tmp_path,
            optim={"lr": 3e-3, "warmup_steps": 0, **optim},
            train={"steps": steps},
            checkpoint=ckpt,
            log={"dir": str(tmp_path / name), "progress": False},
        )
        code, err = _main([str(_write(tmp_path / f"{name}.yaml", raw))])
        assert code == 0, err
        return _metrics(tmp_path / name)

    constant = {"lr_scheduler_type": "constant"}
    whole = run("whole", 8, constant)
    run("first", 4, constant)
    extended = run("extended", 8, constant, tmp_path / "ckpt-first" / "step_000004")
    assert [m["step"] for m in extended] == [5, 6, 7, 8]
    for got, ref in zip(extended, whole[4:], strict=True):
        assert (got["loss"], got["grad_norm"], got["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"])

    cosine = {"lr_scheduler_type": "cosine_with_min_lr", "min_lr_ratio": 0.1}
    four = run("cos4", 4, cosine)
    eight = run("cos8", 8, cosine)
    saved = tmp_path / "ckpt-cos4" / "step_000004"
    refused = yaml.safe_load((tmp_path / "cos4.yaml").read_text())
    refused.update(checkpoint={"dir": str(saved.parent), "resume": str(saved)}, train={"steps": 8})
    code, err = _main([str(_write(tmp_path / "refused.yaml", refused))])
    assert code == 2 and "checkpoint.schedule_change: continue" in err[0] and "replan" in err[0], err
    continued = run("continued", 8, cosine, saved, "continue")
    last = four[-1]["lr"]  # the saved curve's last rate holds past its end
    assert [m["lr"] for m in continued] == pytest.approx([last] * 4, rel=1e-12)
    replanned = run("replanned", 8, cosine, saved, "replan")
    assert [m["lr"] for m in replanned] == pytest.approx([m["lr"] for m in eight[4:]], rel=1e-12)


def test_resume_with_more_steps_of_a_constant_schedule_continues(tmp_path: Path) -> None:
    """``min_lr_ratio: 1`` keeps the rate constant: raising train.steps moves no step's learning rate, so the run
    resumes and trains the new steps at that rate."""
    ckpt = tmp_path / "ckpt"
    raw = run_config(
        tmp_path,
        optim={"lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0},
        train={"steps": 2},
        checkpoint={"dir": str(ckpt), "interval": 2},
    )
    path = _write(tmp_path / "run.yaml", raw)
    assert _main([str(path)])[0] == 0
    code, err = _main([str(path), "--train.steps=3", f"--log.dir={tmp_path / 'more'}"])
    assert code == 0, err
    assert [(m["step"], m["lr"]) for m in _metrics(tmp_path / "more")] == [(3, 3e-3)]


def test_resume_of_a_checkpoint_that_is_gone_names_those_there(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    raw = run_config(tmp_path, train={"steps": 2}, checkpoint={"dir": str(ckpt), "interval": 1, "save_total_limit": 1})
    assert _main([str(_write(tmp_path / "a.yaml", raw))])[0] == 0
    raw["checkpoint"]["resume"] = str(ckpt / "step_000001")  # removed by save_total_limit: 1
    code, err = _main([str(_write(tmp_path / "b.yaml", raw))])
    assert code == 2 and len(err) == 1, err
    assert re.search(r"checkpoint\.resume: .*step_000001 does not exist \(checkpoints in .*: step_000002\)", err[0])
