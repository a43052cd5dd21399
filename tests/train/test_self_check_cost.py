"""What the self-check line's seconds hold: the proof's own work. Ranks that reach the proof apart (one's start-up
took longer) wait for each other before its clock starts, so the line does not charge the proof with a wait the
first step's collectives pay when the proof is off; and the first training forward of a text model under SP (the
proof's) does not import diffusers' model module to look for diffusers models it cannot hold."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime.train.self_check import Comparison, Proof, run_proof
from tests.dist_utils import run_distributed

LATE = 1.0  # seconds rank 1 reaches the proof after rank 0


def late_rank_worker(rank: int, world_size: int) -> str:
    """A proof that does nothing, reached ``LATE`` s later by rank 1; the line rank 0 would print."""
    if rank == 1:
        time.sleep(LATE)
    lines: list[str] = []
    exact = Proof("nothing", [Comparison("one process vs itself", 0.0, {"weight": 0.0}, 1e-4)])
    run_proof(lambda: exact, "train.self_check", lines.append, dist.group.WORLD)
    return lines[0]


@pytest.mark.dist
def test_a_late_rank_is_not_charged_to_the_proof() -> None:
    line, _ = run_distributed(late_rank_worker, 2, timeout=60)
    seconds = float(re.match(r"self-check: passed in ([0-9.]+) s", line).group(1))
    assert seconds < LATE / 2, line  # timed from the first rank's arrival it would report LATE or more


# a fresh process: the test session may have imported diffusers already
TEXT_MODEL_CHECK = """
import sys
import transformers
from runtime.models.registry import lookup
from runtime.parallel.own_checkpointing import own_checkpointing
entry = lookup("qwen3")
model = entry.model_class()(transformers.AutoConfig.for_model("qwen3", **entry.tiny))
model.gradient_checkpointing_enable()
print(own_checkpointing(model), "diffusers.models.modeling_utils" in sys.modules)
"""


def test_a_text_models_forward_check_imports_no_diffusers_model_module() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", TEXT_MODEL_CHECK], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "False"], done.stdout
