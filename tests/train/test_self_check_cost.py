"""What the self-check line's seconds hold: the proof's own work. Ranks that reach the proof apart (one's start-up
took longer) wait for each other before its clock starts, so the line does not charge the proof with a wait the
first step's collectives pay when the proof is off; the first training forward of a text model under SP (the
proof's) does not import diffusers' model module to look for diffusers models it cannot hold; and a planted defect's
first look (a forward without gradients) on rows that hold the same media on every rank runs no dummy tower pass,
its loss bitwise what it was with them."""

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
from tests.train.common import run_config

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


def dummy_passes_worker(rank: int, world_size: int, raw: dict, uniform: bool) -> tuple[list[Comparison], int]:
    """The omni thinker's proof (``raw``'s job, its transformers default config shrunk) with ``towers_uniform`` in
    force or replaced by a context that does nothing: (its planted comparisons, the dummy tower passes it ran)."""
    import contextlib

    import runtime.audio.dummy_forward as audio
    import runtime.train.self_check_text as text
    import runtime.vlm.dummy_forward as vision
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import setup_parallel
    from tests.train.self_check_defects import job_config

    passes = [0]

    def counted(make):
        def inputs(*args, **kwargs):
            passes[0] += 1
            return make(*args, **kwargs)

        return inputs

    config = parse_config(raw)
    state = setup_parallel(config)
    saved = vision.dummy_vision_inputs, audio.dummy_audio_inputs, text.towers_uniform
    vision.dummy_vision_inputs, audio.dummy_audio_inputs = counted(saved[0]), counted(saved[1])
    text.towers_uniform = saved[2] if uniform else contextlib.nullcontext
    try:
        proof = text.prove_text(config, state, job_config(config.model.type))
    finally:
        vision.dummy_vision_inputs, audio.dummy_audio_inputs, text.towers_uniform = saved
        set_parallel_state(None)
    return proof.planted, passes[0]


@pytest.mark.dist
def test_a_planted_defects_first_look_runs_no_dummy_tower_pass(tmp_path: Path) -> None:
    """The thinker's rows are text-only on every rank: each planted defect's first look skips the three dummy
    passes (images, videos, audio) and lands on the same loss, bit for bit; the layout's step keeps its three."""
    raw = run_config(tmp_path, model={"type": "qwen3_omni_moe_thinker", "config": {}}, parallel={"sp": 2})
    raw["data"] = {**raw["data"], "processor": str(tmp_path / "processor"), "tokenizer": None}
    (with_dummies, before), _ = run_distributed(dummy_passes_worker, 2, raw, False, timeout=300)
    (without, after), _ = run_distributed(dummy_passes_worker, 2, raw, True, timeout=300)
    assert [(c.what, c.loss_error, c.errors) for c in without] == [
        (c.what, c.loss_error, c.errors) for c in with_dummies
    ]
    looks = len(with_dummies)
    full_steps = sum(any(e > 0 for e in c.errors.values()) for c in with_dummies)  # judged on gradients too
    assert looks >= 2 and before == 3 * (1 + looks + full_steps) and after == 3 * (1 + full_steps), (before, after)
