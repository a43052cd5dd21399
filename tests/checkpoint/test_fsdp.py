"""World size 2 with FSDP2 (gloo, fp32): exact resume from a sharded DCP checkpoint, and export of the sharded
model to a directory plain transformers loads. One spawn trains without interruption (saving on the way) and
exports; a second spawn resumes."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tests.checkpoint.common import SAVE_AT, TOTAL_STEPS, build, full_params, train
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.dist

WORLD = 2
CONFIG = {"attention_dropout": 0.1, "tie_word_embeddings": True}


def _export_and_compare(model, config, out: Path, state, rank: int) -> dict | None:
    """Export, then (rank 0) load with plain transformers; logits of both on the same input, eval mode."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from runtime.checkpoint import export_hf

    export_hf(model, config, out, state)
    model.eval()
    input_ids = torch.randint(1, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(input_ids=input_ids).logits  # every rank: the forward all-gathers
    if rank != 0:
        return None
    upstream = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    with torch.no_grad():
        theirs = upstream(input_ids=input_ids).logits
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = sorted(f.keys())
    return {
        "ours": ours,
        "theirs": theirs,
        "class": type(upstream).__module__,
        "keys": keys,
        "files": sorted(os.listdir(out)),
    }


def _uninterrupted(rank: int, world_size: int, root: Path, export_root: Path) -> dict:
    from runtime.checkpoint import save_checkpoint
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state()
    config, model, optimizer, scheduler = build(state=state, **CONFIG)
    torch.manual_seed(100 + rank)  # a dropout stream per rank: the per-rank RNG states must go back to their rank
    random.seed(rank)
    losses = train(model, optimizer, scheduler, 0, SAVE_AT, rank, world_size)
    save_checkpoint(root, SAVE_AT, model, optimizer, scheduler, extra={"step": SAVE_AT, "rank": rank})
    losses += train(model, optimizer, scheduler, SAVE_AT, TOTAL_STEPS, rank, world_size)
    result = {"losses": losses, "params": full_params(model), "lr": scheduler.get_last_lr()}
    exports = {"tied_qwen3": _export_and_compare(model, config, export_root / "tied_qwen3", state, rank)}

    config, model, optimizer, scheduler = build(state=state, tie_word_embeddings=False)
    train(model, optimizer, scheduler, 0, 1, rank, world_size)
    exports["untied_qwen3"] = _export_and_compare(model, config, export_root / "untied_qwen3", state, rank)
    return {**result, "exports": exports}


def _resumed(rank: int, world_size: int, root: Path) -> dict:
    from runtime.checkpoint import latest_checkpoint, load_checkpoint
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state()
    torch.manual_seed(4321)
    random.seed(4321)
    _, model, optimizer, scheduler = build(seed=77, state=state, **CONFIG)  # other weights: must come from disk
    extra = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
    losses = train(model, optimizer, scheduler, extra["step"], TOTAL_STEPS, rank, world_size)
    return {"extra": extra, "losses": losses, "params": full_params(model), "lr": scheduler.get_last_lr()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    root = tmp / "ckpt"
    return tmp, run_distributed(_uninterrupted, WORLD, root, tmp / "export", timeout=240)


def test_fsdp_exact_resume(uninterrupted: tuple[Path, list[dict]]) -> None:
    tmp, full_run = uninterrupted
    checkpoint = tmp / "ckpt" / f"step_{SAVE_AT:06d}"
    files = sorted(p.name for p in checkpoint.iterdir())
    assert files == [
        ".metadata",
        "COMPLETE",
        "__0_0.distcp",
        "__1_0.distcp",
        "rank_00000.json",
        "rank_00000.safetensors",
        "rank_00001.json",
        "rank_00001.safetensors",
    ]

    resumed = run_distributed(_resumed, WORLD, tmp / "ckpt", timeout=240)
    assert not torch.equal(full_run[0]["losses"][-1], full_run[1]["losses"][-1])  # the ranks really differ
    for rank, (full, res) in enumerate(zip(full_run, resumed, strict=True)):
        assert res["extra"] == {"step": SAVE_AT, "rank": rank}
        assert res["lr"] == full["lr"]
        for got, want in zip(res["losses"], full["losses"][SAVE_AT:], strict=True):
            assert torch.equal(got, want), (rank, got, want)
    params, want = resumed[0]["params"], full_run[0]["params"]
    assert params.keys() == want.keys() and len(want) > 20
    for name, value in want.items():
        assert torch.equal(params[name], value), name


@pytest.mark.parametrize("case", ["tied_qwen3", "untied_qwen3"])
def test_fsdp_export_loads_in_plain_transformers(uninterrupted: tuple[Path, list[dict]], case: str) -> None:
    _, full_run = uninterrupted
    got = full_run[0]["exports"][case]
    assert full_run[1]["exports"][case] is None
    assert got["class"].startswith("transformers.models.")
    assert got["files"] == ["config.json", "generation_config.json", "model.safetensors", "patchgen_export.json"]
    assert ("lm_head.weight" in got["keys"]) is (case == "untied_qwen3")  # a tied copy is not saved
    assert torch.equal(got["ours"], got["theirs"])
