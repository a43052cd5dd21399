"""Loading a checkpoint into the generated class as every rank does: one progress bar per run, on rank 0."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import transformers

from runtime.models.registry import lookup
from runtime.models.tiny_configs import tiny_config
from runtime.parallel.state import ParallelState, parallel_state
from runtime.train.model import load_pretrained


def test_only_rank_zero_shows_the_loading_bar(tmp_path: Path) -> None:
    """transformers draws a "Loading weights" bar per load; in a multi-rank log (not a TTY) every rank's bar was
    printed. The ranks other than 0 load without it, and the bar setting is restored afterwards."""
    transformers.utils.logging.enable_progress_bar()  # an earlier test of the session may have turned bars off
    cls = lookup("qwen3").model_class()
    cls(tiny_config("qwen3")).save_pretrained(tmp_path / "ckpt")
    printed = {}
    for rank in (0, 1):
        err = io.StringIO()
        layout = ParallelState(world_size=2, rank=rank, dp_shard_size=2)  # the handle only: no process group needed
        with contextlib.redirect_stderr(err), parallel_state(layout):
            load_pretrained(cls, str(tmp_path / "ckpt"))
        printed[rank] = err.getvalue()
    assert "Loading weights" in printed[0] and printed[1] == "", printed
    assert transformers.utils.logging.is_progress_bar_enabled()
