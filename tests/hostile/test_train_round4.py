"""Hostile inputs for ``python -m runtime.train`` (round 4): a command-line override nested past the config file's
cap, an MLflow tracking server at a closed port, and the TFLOP/s of a step whose real tokens are not its budget.

Rule: a user error is one ``error:`` line and exit code 2, in seconds; a metric says what the step computed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.train.common import run_config, run_main

ROOT = Path(__file__).resolve().parents[2]


def _train_cli(config: Path, *args: str, timeout: float = 120) -> tuple[int, list[str]]:
    """``python -m runtime.train config *args`` in a subprocess (a RecursionError there cannot take pytest down)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "runtime.train", str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    return done.returncode, done.stderr.strip().splitlines()


# ------------------------------------------------------------------------------------------ override nesting cap


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("levels", [33, 60000], ids=["past-the-cap", "60000-deep"])
def test_a_deeply_nested_override_is_one_error_line(tmp_path: Path, levels: int) -> None:
    from runtime.config.shape import MAX_CONFIG_DEPTH

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config(tmp_path)))
    code, lines = _train_cli(config, f"--train.steps={_deep(levels)}")
    assert code == 2 and len(lines) == 1, (code, lines[-5:])
    assert lines[0].startswith("error: override --train.steps: nested more than "), lines
    assert f"{MAX_CONFIG_DEPTH} levels" in lines[0] and "Traceback" not in lines[0], lines


def test_an_override_within_the_cap_is_read() -> None:
    from runtime.config.overrides import parse_overrides
    from runtime.config.shape import MAX_CONFIG_DEPTH
    from runtime.config.yaml_file import ConfigLoader

    (item,) = parse_overrides([f"--model.config.x={_deep(MAX_CONFIG_DEPTH - 4)}"], ConfigLoader)
    depth, value = 0, item.value
    while isinstance(value, list):
        depth, value = depth + 1, value[0] if value else None
    assert depth == MAX_CONFIG_DEPTH - 4


def test_an_alias_bomb_override_is_capped_like_the_file(tmp_path: Path) -> None:
    """A few characters that expand to 10**6 values once the aliases are expanded: the file loader's value cap."""
    from runtime.config.overrides import OverrideError, parse_overrides
    from runtime.config.yaml_file import ConfigLoader

    levels = ["a: &a [1,1,1,1,1,1,1,1,1,1]"]
    for k, name in enumerate("bcdef"):
        prev = "abcdef"[k]
        levels.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]")
    bomb = "{" + ", ".join(levels) + "}"
    with pytest.raises(OverrideError) as caught:
        parse_overrides([f"--model.config={bomb}"], ConfigLoader)
    message = str(caught.value)
    assert message.startswith("override --model.config: more than 100000 values") and "\n" not in message


# ---------------------------------------------------------------------------------- MLflow server at a closed port


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_mlflow_server_at_a_closed_port_fails_in_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the start-up probe MLflow's client retries for about 270 s before it gives up. Timed: the tracker's
    start (the run's own start-up before it, a tiny model's build, is not what is measured: it is load-dependent)."""
    from runtime.train.tracking import run_log

    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spent: list[float] = []

    def timed_open(*args, **kwargs):
        started = time.monotonic()
        try:
            return opener(*args, **kwargs)
        finally:
            spent.append(time.monotonic() - started)

    opener = run_log.open_tracker
    monkeypatch.setattr(run_log, "open_tracker", timed_open)
    raw = run_config(tmp_path, train={"steps": 1}, log={"report_to": ["mlflow"]})
    code, stderr = run_main(raw, tmp_path)
    seconds = sum(spent)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr[-2000:])
    config = tmp_path / "run.yaml"
    assert lines[0].startswith(f"error: {config}:"), lines  # the line of log.report_to in the file
    assert "log.report_to: mlflow could not start a run: " in lines[0], lines
    assert uri in lines[0] and "MLFLOW_TRACKING_URI" in lines[0], lines
    assert seconds < 15, seconds


def test_mlflow_probe_is_quick_and_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracker alone (no model): a refused connection is reported in well under a second of probing."""
    from runtime.config.common import LogConfig
    from runtime.config.errors import ConfigError
    from runtime.train.tracking.run_log import RunLog

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}/")
    log = LogConfig(dir=str(tmp_path / "log"), report_to=["mlflow"], project="p", progress=False)
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        RunLog(log, total_steps=1, enabled=True)
    assert time.monotonic() - started < 10
    assert "\n" not in str(caught.value) and "refused" in str(caught.value), caught.value


# ------------------------------------------------------------------------------ TFLOP/s from the real tokens


def test_step_flops_count_the_real_tokens_of_packed_rows_not_the_budget() -> None:
    """Two packed rows of a 128-token budget: one holds documents of 100 and 20 tokens, one a document of 50. The
    FLOPs of the step are those of 170 tokens, with causal attention inside each document, written out here."""
    from runtime.train.metrics import flops_per_token, step_flops, tflops_per_device

    config = SimpleNamespace(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
    )
    budget = 128
    rows = [
        {"position_ids": torch.cat([torch.arange(100), torch.arange(20)])},
        {"position_ids": torch.arange(50)[None]},  # (1, L)
    ]
    # 6 x matmul params per token: q/k/v/o (64 x 16 x (2 x 4 + 2 x 2)), the gated MLP (3 x 64 x 128) per layer, the
    # LM head (64 x 256); causal attention fwd+bwd: 6 x layers x heads x head_dim per token pair of one document.
    params = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128) + 64 * 256
    expected = 6 * params * (100 + 20 + 50) + 6 * 2 * 4 * 16 * (100**2 + 20**2 + 50**2)
    assert step_flops(config, rows) == pytest.approx(expected, rel=1e-12)
    by_budget = flops_per_token(config, budget) * (120 + 50)  # what the console showed: attention over the budget
    assert abs(by_budget - expected) / expected > 0.05
    assert tflops_per_device(expected, 0.5, 4) == pytest.approx(expected / 0.5 / 4 / 1e12, rel=1e-12)


def test_step_flops_of_a_multimodal_row() -> None:
    """A VLM row's position ids are (4, 1, L) with the text positions first: documents restart at 0 there."""
    from runtime.train.metrics import document_lengths

    text = torch.cat([torch.arange(7), torch.arange(5), torch.arange(3)])
    position_ids = torch.stack([text, text * 0 + 1, text * 0 + 2, text * 0 + 3])[:, None]
    assert document_lengths(position_ids) == [7, 5, 3]
    assert document_lengths(text) == [7, 5, 3]
