"""The text-trainer demo: tiny qwen3, sp=2 on 2 CPU processes, 30 steps, resume from step 15, export.

Run through `make demo` (runtime/demo.py), or alone: `python -m runtime.demos.train_text`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from runtime.data.text.corpus import corpus_path
from runtime.tiny import write_tokenizer

STEPS, SAVE_EVERY, MOE_STEPS = 30, 15, 12
MODEL = {
    "vocab_size": 512,
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


MOE_MODEL = {
    **MODEL,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}


def write_config(work: Path, log_dir: str, moe: bool = False) -> Path:
    raw = {
        "model": {"type": "qwen3_moe", "config": MOE_MODEL, "seed": 0}
        if moe
        else {"type": "qwen3", "config": MODEL, "seed": 0},
        "data": {"path": str(corpus_path()), "tokenizer": str(work / "tokenizer"), "token_budget": 512},
        "parallel": {"ep": 2} if moe else {"sp": 2},
        "optim": {"lr": 4e-3, "warmup_steps": 3, "min_lr_ratio": 0.1},
        "train": {"steps": MOE_STEPS if moe else STEPS, "loss_chunk_size": 256},
        "checkpoint": {"dir": str(work / ("ckpt-moe" if moe else "ckpt")), "interval": 0 if moe else SAVE_EVERY},
        "log": {"dir": str(work / log_dir), "progress": False, "interval": 10},
        "export": {"dir": None if moe else str(work / f"hf-{log_dir}")},
    }
    path = work / f"{log_dir}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def torchrun(config: Path) -> None:
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [str(torchrun_bin), "--standalone", "--nproc-per-node", "2", "-m", "runtime.train", str(config)],
        check=True,
        env=env,
    )


def losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def main() -> bool:
    import transformers

    from runtime.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from runtime.models.registry import causal_lm_class
    from runtime.train.model import load_pretrained

    work = Path(tempfile.mkdtemp(prefix="patchgen-demo-"))
    try:
        write_tokenizer(work / "tokenizer")  # what `python -m runtime.tiny tokenizer DIR` writes
        print(f"-- training {STEPS} steps, checkpoint every {SAVE_EVERY} (torchrun, 2 processes, sp=2)", flush=True)
        torchrun(write_config(work, "run"))
        straight = losses(work / "run")
        shutil.rmtree(work / "ckpt" / f"step_{STEPS:06d}")
        print(f"-- restarting from the step-{SAVE_EVERY} checkpoint", flush=True)
        torchrun(write_config(work, "resumed"))
        resumed = losses(work / "resumed")
        print(f"{'step':>5} {'loss':>10} {'resumed':>10}")
        for step in sorted(straight):
            again = f"{resumed[step]:10.5f}" if step in resumed else f"{'':>10}"
            print(f"{step:>5} {straight[step]:10.5f} {again}")
        same = all(resumed[s] == straight[s] for s in resumed if s > SAVE_EVERY) and len(resumed) > 1
        falling = straight[STEPS] < straight[1] - 0.5
        # missing/unexpected/mismatched weights are an error (one line naming them), never a warning
        plain = load_pretrained(
            transformers.AutoModelForCausalLM, str(work / "hf-resumed"), attn_implementation="sdpa"
        )
        ours = causal_lm_class("qwen3")(plain.config)
        load_checkpoint(latest_checkpoint(work / "ckpt"), ours, restore_rng=False)
        ids = torch.randint(0, MODEL["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
        plain.eval(), ours.eval()
        exported = torch.equal(plain(ids).logits, ours(ids).logits)
        trend = "falling" if falling else "NOT falling"
        print(f"loss step 1 -> {STEPS}: {straight[1]:.4f} -> {straight[STEPS]:.4f} ({trend})")
        print(f"resumed steps {SAVE_EVERY + 1}-{STEPS} bitwise equal to the uninterrupted run: {same}")
        print(f"plain transformers loads the export with identical logits: {exported}")
        print(
            f"-- qwen3_moe, {MOE_STEPS} steps, ep=2 (8 experts, 4 per rank, tokens exchanged by all-to-all)",
            flush=True,
        )
        torchrun(write_config(work, "moe", moe=True))
        moe = losses(work / "moe")
        moe_falling = moe[MOE_STEPS] < moe[1] - 0.3
        print(
            f"qwen3_moe loss step 1 -> {MOE_STEPS}: {moe[1]:.4f} -> {moe[MOE_STEPS]:.4f} "
            f"({'falling' if moe_falling else 'NOT falling'})"
        )
        return same and falling and exported and moe_falling
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
