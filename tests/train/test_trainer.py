"""The text trainer end to end: SP=2 vs SP=1 per step, exact resume, export, and user errors (exit code 2)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.dist_utils import run_distributed
from tests.train.common import TINY_MOE, assert_steps_match, one_process_steps, run_config, train_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [{"sp": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_sp2_matches_sp1_every_step(tmp_path: Path, parallel: dict) -> None:
    reference, witness = one_process_steps(run_config(tmp_path))
    per_rank = run_distributed(train_worker, 2, run_config(tmp_path, parallel=parallel), timeout=300)
    for rank_metrics in per_rank:
        sp2 = rank_metrics[:-1]
        assert [m["step"] for m in sp2] == [1, 2, 3, 4, 5]
        assert_steps_match(sp2, reference, witness, str(parallel))


@pytest.mark.dist
def test_moe_ep2_matches_single_process_every_step(tmp_path: Path) -> None:
    """qwen3_moe, 3 steps: ep=2 on 2 ranks (grouped kernel) against one process (eager experts).

    ep=2 on 2 ranks means 2 data-parallel replicas, each taking one row per step (row j goes to replica j % 2);
    one process with 2 micro-batches takes the same two rows per step. The load-balancing term is left out here:
    over micro-batches it is computed per row, across replicas over both rows (tests/parity/test_moe_parallel.py
    checks the global version).
    """
    moe = {"type": "qwen3_moe", "config": {**TINY_MOE, "router_aux_loss_coef": 0.0}}
    eager = {**moe, "experts_implementation": "eager"}
    reference, witness = one_process_steps(run_config(tmp_path, model=eager, train={"steps": 3, "micro_batches": 2}))
    per_rank = run_distributed(
        train_worker, 2, run_config(tmp_path, model=moe, parallel={"ep": 2}, train={"steps": 3}), timeout=300
    )
    assert_steps_match(per_rank[0][:-1], reference, witness, "ep2", tokens=False)


def test_resume_is_bitwise_identical(tmp_path: Path) -> None:
    """Six steps straight vs. the same run restarted in a new process from its step-3 checkpoint: `resume: auto`
    skips the newest checkpoint (step 6), damaged by 4 KiB of random bytes in a shard, and says so."""
    from tests.checkpoint.test_verify import _distcp, _noise

    raw = run_config(
        tmp_path,
        train={"steps": 6},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 3},
        model={"config": {**run_config(tmp_path)["model"]["config"], "attention_dropout": 0.1}},
    )
    straight = run_distributed(train_worker, 1, raw, timeout=300)[0][:-1]
    _noise(_distcp(tmp_path / "ckpt" / "step_000006"))
    resumed = run_distributed(train_worker, 1, raw, timeout=300)[0]
    assert resumed[-1]["start_step"] == 3
    (skipped,) = resumed[-1]["skipped"]
    assert "step_000006" in skipped and "sha256" in skipped
    for got, ref in zip(resumed[:-1], straight[3:], strict=True):
        assert got["step"] == ref["step"]
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)


def test_export_loads_in_plain_transformers(tmp_path: Path) -> None:
    import transformers

    from runtime.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from runtime.models.registry import causal_lm_class

    raw = run_config(
        tmp_path,
        train={"steps": 2},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2},
        export={"dir": str(tmp_path / "hf")},
    )
    run_distributed(train_worker, 1, raw, timeout=300)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    assert type(plain).__module__.startswith("transformers.")
    ours = causal_lm_class("qwen3")(plain.config)
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), ours, restore_rng=False)
    ids = torch.randint(0, 512, (1, 33), generator=torch.Generator().manual_seed(0))
    plain.eval(), ours.eval()
    assert torch.equal(plain(ids).logits, ours(ids).logits)


def run_cli(config: dict | str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "run.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "runtime.train", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_malformed_yaml_exits_2(tmp_path: Path) -> None:
    """The real `python -m runtime.train` entry point (the other user errors run in-process: test_user_errors.py)."""
    done = run_cli("model: [unclosed\n", tmp_path)
    assert done.returncode == 2 and "not valid YAML" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.dist
def test_moe_ep2_resume_and_export(tmp_path: Path) -> None:
    """Expert-parallel checkpoints (experts are DTensors on the ep mesh) resume bitwise and export to plain HF."""
    import transformers

    from runtime.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from runtime.models.registry import causal_lm_class

    raw = run_config(
        tmp_path,
        model={"type": "qwen3_moe", "config": TINY_MOE},
        parallel={"ep": 2},
        train={"steps": 4},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2},
        export={"dir": str(tmp_path / "hf"), "overwrite": True},  # the resumed run exports again
    )
    straight = run_distributed(train_worker, 2, raw, timeout=300)[0][:-1]
    shutil.rmtree(tmp_path / "ckpt" / "step_000004")
    resumed = run_distributed(train_worker, 2, raw, timeout=300)[0]
    assert resumed[-1]["start_step"] == 2
    for got, ref in zip(resumed[:-1], straight[2:], strict=True):
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)

    plain = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="sdpa", experts_implementation="eager"
    )
    ours = causal_lm_class("qwen3_moe")(plain.config)
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), ours, restore_rng=False)
    ids = torch.randint(0, 512, (1, 29), generator=torch.Generator().manual_seed(0))
    plain.eval(), ours.eval()
    assert torch.equal(plain(ids).logits, ours(ids).logits)
