"""Errors of several command-line overrides come in the order they were typed (after the file's, by line), so the
first line answers the first override (the config checks otherwise run section by section). Checked where
``runtime.train`` and ``runtime.rl`` read their configs (``runtime.config.yaml_file.load_config``), without torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runtime.config.errors import ConfigError
from runtime.config.overrides import parse_overrides
from runtime.config.yaml_file import ConfigLoader
from runtime.train.config import load_run_config
from tests.train.common import TINY_MODEL


def test_override_errors_come_in_command_line_order(tmp_path: Path) -> None:
    raw = {
        "model": {"type": "qwen3", "config": TINY_MODEL},
        "data": {"path": "corpus.jsonl", "tokenizer": "tokenizer"},  # read at launch, not when parsed
        "optim": {"lr": float("inf")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    typed = ["--train.steps=0", "--optim.weight_decay=x", "--optim.lrr=1", "--log.report_to=[x]"]
    typed += ["--train.steps", "-1"]
    with pytest.raises(ConfigError) as caught:
        load_run_config(path, parse_overrides(typed, ConfigLoader))
    messages = caught.value.messages
    # the file's error first; then one line per key, in the order typed; a key typed twice is answered for the
    # value that won, at its place
    assert [m.split(": ")[0] for m in messages] == [
        f"{path}:{next(n for n, t in enumerate(path.read_text().splitlines(), 1) if t.strip().startswith('lr:'))}",
        "override --optim.weight_decay",
        "override --optim.lrr",
        "override --log.report_to",
        "override --train.steps",
    ], messages
    assert messages[-1].endswith("must be positive, found -1"), messages
