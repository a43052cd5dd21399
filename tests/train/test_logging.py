"""Logging of the trainer and the RL job (``runtime/train/tracking``), read back with each tracker's own reader:

* a tiny text run with ``report_to: [tensorboard, wandb, mlflow]`` (W&B offline, MLflow on a file store): the
  TensorBoard events (``EventAccumulator``; float32 scalars), the W&B run (``wandb leet inspect --json``, W&B's
  reader of ``.wandb`` files) and the MLflow run (``MlflowClient.get_metric_history``, params) hold the JSONL's
  values, the run config and the loss PNG (a PNG PIL opens, of real size); the console lines written off a
  terminal carry timestamp, elapsed time and ETA;
* the console on a terminal (tqdm) and off it (samples/s);
* the curve follows the lineage of the run that wrote last (a fresh run, a crashed run, its resume);
* a tracker that cannot start, or is not installed, is a one-line config error;
* an RL run writes the reward/loss PNG and its metrics to the trackers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.rl.common import rl_config, tiny_pipelines  # noqa: F401  (the session fixture)
from tests.train.common import run_config

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step +(\d+)/(\d+) loss [\d.]+ .* tok/s [\d,]+ .*"
    r"\| elapsed \d+:\d\d:\d\d eta \d+:\d\d:\d\d$"
)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tiny models on a shared 2-core machine: intra-op threads cost wall time and change no result here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _train(raw: dict):
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import train

    with torch.random.fork_rng(devices=[]):
        try:
            return train(parse_config(raw))
        finally:
            set_parallel_state(None)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wandb_history(log_dir: Path) -> tuple[dict, list[dict]]:
    """(the run's config, its history records) as ``wandb leet inspect --json`` reads the run's .wandb file."""
    [run_file] = (log_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    [run] = [r["run"] for r in records if r["type"] == "run"]
    return run["config"]["update"], [r["history"] for r in records if r["type"] == "history"]


def test_text_run_trackers_hold_the_jsonl_values(tmp_path: Path, monkeypatch, capsys) -> None:
    from mlflow.tracking import MlflowClient
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    raw = run_config(
        tmp_path,
        train={"steps": 3},
        log={"report_to": ["tensorboard", "wandb", "mlflow"], "project": "logtest", "run_name": "tiny", "interval": 2},
    )
    _train(raw)
    log_dir = tmp_path / "log"
    expected = _jsonl(log_dir / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3]
    keys = ("loss", "grad_norm", "lr", "tokens_per_s")
    png = log_dir / "loss.png"

    events = EventAccumulator(str(log_dir / "tb"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    for key in keys:  # TensorBoard keeps scalars as float32
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], float(np.float32(r[key]))) for r in expected], key
    assert [e.step for e in events.Images("plots/loss")] == [3]

    config, history = _wandb_history(log_dir)
    assert config["optim"]["lr"] == raw["optim"]["lr"] and config["train"]["steps"] == 3
    metrics = [h for h in history if "loss" in h["item"]]
    for key in keys:
        assert [(h["step"]["num"], h["item"][key]) for h in metrics] == [(r["step"], r[key]) for r in expected], key
    [plot] = [h for h in history if h["item"].get("plots/loss._type") == "image-file"]
    assert plot["step"]["num"] == 3 and plot["item"]["plots/loss.format"] == "png"
    [run_dir] = (log_dir / "wandb").glob("offline-run-*")
    assert (run_dir / "files" / plot["item"]["plots/loss.path"]).stat().st_size == png.stat().st_size

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("logtest").experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    for key in keys:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert got == [(r["step"], r[key]) for r in expected], key
    assert run.data.params["optim.lr"] == str(raw["optim"]["lr"]) and run.data.params["train.steps"] == "3"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["loss.png"]

    assert png.stat().st_size > 10_000
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 400

    lines = [line for line in capsys.readouterr().out.splitlines() if " step " in line]
    assert [LINE.match(line).groups() for line in lines] == [("2", "3"), ("3", "3")], lines


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_lines_on_and_off_a_terminal() -> None:
    from runtime.train.tracking.console import Console

    off = io.StringIO()
    console = Console(off, total_steps=10, start_step=4, samples_per_step=8)
    console.step_line(5, "step 5/10 loss 1.0")
    console.step_line(7, "step 7/10 loss 0.9")
    first, second = off.getvalue().splitlines()
    pattern = (
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step (\d)/10 loss [\d.]+ \| elapsed 0:00:00 eta 0:00:00 samples/s [\d,.]+$"
    )
    assert re.match(pattern, first) and re.match(pattern, second), (first, second)

    on = _Terminal()
    console = Console(on, total_steps=10, start_step=4, samples_per_step=8)
    console.advance(5, "loss 1.0")
    console.step_line(5, "step 5/10 loss 1.0")
    console.close()
    text = on.getvalue()
    assert "step 5/10 loss 1.0\n" in text and "5/10" in text and "elapsed" not in text  # the bar shows its own
    assert not re.search(r"^\d{4}-\d\d-\d\d ", text, re.M)


def test_offline_dpo_console_line_shows_its_implicit_reward(tmp_path: Path) -> None:
    """DPO scores nothing: its console line shows the implicit reward's accuracy and margin beside the loss."""
    from runtime.config.common import LogConfig
    from runtime.rl.metrics import RLMetricsLogger

    out = io.StringIO()
    logger = RLMetricsLogger(LogConfig(dir=str(tmp_path / "log"), progress=False), 2, True, stream=out)
    metrics = {"step": 1, "policy_loss": 0.6931, "implicit_reward_accuracy": 0.75, "implicit_reward_margin": 0.01}
    logger.log(metrics, echo=True)
    logger.close()
    assert "loss 6.931e-01 reward_acc 0.750 margin 1.000e-02" in out.getvalue(), out.getvalue()


def test_curve_follows_the_run_that_wrote_last(tmp_path: Path) -> None:
    from runtime.train.tracking.plots import run_history

    path = tmp_path / "metrics.jsonl"
    rows = [
        *({"step": s, "loss": 10.0 + s} for s in (1, 2, 3)),  # an older run in the same directory
        *({"step": s, "loss": 20.0 + s} for s in (1, 2, 3, 4, 5)),  # a fresh run that crashed after step 5
        {"step": 5, "eval_loss": 7.0},  # an eval record of step 5 merges with it
        *({"step": s, "loss": 30.0 + s} for s in (4, 5, 6)),  # resumed from its step-3 checkpoint
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')  # a line cut by a kill
    assert run_history(path) == [
        {"step": 1, "loss": 21.0},
        {"step": 2, "loss": 22.0},
        {"step": 3, "loss": 23.0},
        {"step": 4, "loss": 34.0},
        {"step": 5, "loss": 35.0},
        {"step": 6, "loss": 36.0},
    ]


def test_tracker_that_cannot_start_is_one_config_line(tmp_path: Path, monkeypatch) -> None:
    from runtime.config.errors import ConfigError

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    raw = run_config(tmp_path, train={"steps": 1}, log={"report_to": ["wandb"]})
    with pytest.raises(ConfigError) as caught:
        _train(raw)
    message = str(caught.value)
    assert message.startswith("log.report_to: wandb could not start a run: ") and "\n" not in message
    assert "WANDB_API_KEY" in message and "WANDB_MODE=offline" in message
    assert not (tmp_path / "log" / "metrics.jsonl").exists()


def test_a_run_ended_by_an_error_is_marked_failed(tmp_path: Path, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    from runtime.config.common import LogConfig
    from runtime.train.tracking.run_log import RunLog

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    log = LogConfig(dir=str(tmp_path / "log"), report_to=["mlflow"], project="failing", progress=False)
    for fails in (False, True):
        run = RunLog(log, total_steps=2, enabled=True, run_config={"n": fails}, stream=io.StringIO())
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            try:
                run.record({"step": 1, "loss": 1.0})
                if fails:
                    raise RuntimeError("a step failed")
            finally:
                run.close()
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    assert sorted((r.data.params["n"], r.info.status) for r in runs) == [("False", "FINISHED"), ("True", "FAILED")]


def test_missing_tracker_is_a_config_error_before_torch(tmp_path: Path) -> None:
    """``wandb`` made unimportable (``sys.modules['wandb'] = None``, as in an environment without the extra): the
    config check names the extra, in one line, without importing torch."""
    import yaml

    raw = run_config(tmp_path, train={"steps": 1}, log={"report_to": ["tensorboard", "wandb"]})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    rl_raw = rl_config("flux", tmp_path / "pipeline", tmp_path, log={"report_to": ["wandb"]})  # the RL job's check
    script = (
        "import sys\n"
        "sys.modules['wandb'] = None\n"  # Python's marker of a module that cannot be imported: find_spec says None
        "from runtime.config.errors import ConfigError\n"
        "from runtime.train.config import load_run_config\n"
        "try:\n"
        f"    load_run_config({str(config)!r})\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "from runtime.rl.config import parse_rl_config\n"
        "try:\n"
        f"    parse_rl_config({rl_raw!r})\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out
    assert re.match(r".*run\.yaml:\d+: log\.report_to\[1\]: wandb is not installed; .*patchgen\[wandb\]", lines[0])
    assert re.match(r"log\.report_to\[0\]: wandb is not installed; .*patchgen\[wandb\]", lines[1])
    assert lines[2] == "torch not imported"


def test_rl_run_writes_the_reward_curve_to_the_trackers(tiny_pipelines, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    from mlflow.tracking import MlflowClient
    from PIL import Image

    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, log={"report_to": ["mlflow"], "project": "rltest"})
    run_rl(parse_rl_config(raw))
    log_dir = tmp_path / "log"
    expected = _jsonl(log_dir / "metrics.jsonl")
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("rltest").experiment_id])
    keys = [k for k in expected[0] if k.startswith(("reward", "policy_loss"))]
    assert {"reward", "reward_std", "policy_loss", "reward/callable0"} <= set(keys)
    for key in keys:  # MLflow's names have "." for "/"
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key.replace("/", ".")))
        assert got == [(r["step"], r[key]) for r in expected], key
    assert run.data.params["algo.group_size"] == "2" and run.data.params["algorithm"] == "flowgrpo"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["reward_loss.png"]
    with Image.open(log_dir / "reward_loss.png") as image:
        assert image.format == "PNG" and image.size[1] >= 400
