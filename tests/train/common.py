"""A tiny, fast run configuration and a worker that trains with it (module-level so spawn can pickle it)."""

from __future__ import annotations

import copy
from pathlib import Path

TINY_MODEL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


TINY_MOE = {
    **TINY_MODEL,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}


def tokenizer_dir(root: Path) -> Path:
    from runtime.data.text.corpus import corpus_path
    from runtime.data.text.tokenization import build_test_tokenizer

    target = root / "tokenizer"
    if not (target / "tokenizer.json").exists():
        build_test_tokenizer(target, corpus_path().read_text(encoding="utf-8"))
    return target


def run_config(root: Path, **sections) -> dict:
    from runtime.data.text.corpus import corpus_path

    raw = {
        "model": {"type": "qwen3", "config": copy.deepcopy(TINY_MODEL), "seed": 0},
        "data": {"path": str(corpus_path()), "tokenizer": str(tokenizer_dir(root)), "token_budget": 128},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": 5},
        "log": {"dir": str(root / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


# the paths a run writes: a witness run (tests.tolerance.references) beside the reference gets its own
WRITTEN = (("log", "dir"), ("checkpoint", "dir"), ("export", "dir"), ("data", "cache"))


def witness_config(raw: dict) -> dict:
    """``raw`` writing its log, checkpoints, export and condition cache to paths of its own (``-witness``)."""
    raw = copy.deepcopy(raw)
    for section, key in WRITTEN:
        if raw.get(section, {}).get(key):
            raw[section][key] = str(raw[section][key]) + "-witness"
    return raw


def train_worker(rank: int, world_size: int, raw: dict) -> list[dict]:
    """Train with `raw`; every rank returns its per-step metrics, then what the run was: the step it started from,
    its intra-op threads, the checkpoints it skipped and, with ``train.compile``, the graphs dynamo compiled."""
    import dataclasses

    import torch

    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import train

    compiling = bool(raw.get("train", {}).get("compile"))
    if compiling:
        from torch._dynamo.utils import counters

        counters.clear()
    try:
        result = train(parse_config(raw))
    finally:
        set_parallel_state(None)
    return [dataclasses.asdict(m) for m in result.metrics] + [
        {
            "start_step": result.start_step,
            "threads": torch.get_num_threads(),
            "skipped": list(getattr(result, "skipped_checkpoints", ["(not reported)"])),
            "compiled_graphs": int(counters["stats"]["unique_graphs"]) if compiling else 0,
        }
    ]


def run_main(raw: dict | str, root: Path) -> tuple[int, str]:
    """``python -m runtime.train`` in this process (no torch import per case): exit code and stderr.

    The global RNG and the parallel-state handle the trainer sets are given back afterwards.
    """
    import contextlib
    import io

    import torch
    import yaml

    from runtime.parallel.state import set_parallel_state
    from runtime.train.__main__ import main

    path = root / "run.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    err = io.StringIO()
    with torch.random.fork_rng(devices=[]), contextlib.redirect_stderr(err):
        try:
            code = main([str(path)])
        finally:
            set_parallel_state(None)
    return code, err.getvalue()


def one_process_steps(raw: dict) -> tuple[list[dict], list[dict]]:
    """``raw`` trained on one rank (the reference) and, alongside, on a rank whose kernels sum in other orders (the
    rounding model's witness, ``tests.dist_utils.start_reordered``; its own output paths): their per-step metrics."""
    from tests.dist_utils import run_distributed, start_reordered

    pending = start_reordered(train_worker, witness_config(raw))
    reference = run_distributed(train_worker, 1, raw, timeout=300)[0][:-1]
    return reference, pending()[:-1]


def assert_steps_match(got: list[dict], ref: list[dict], witness: list[dict], what: str, tokens: bool = True) -> None:
    """Per-step loss and gradient norm within the rounding model (``tests.tolerance``); the steps equal, and their
    token counts (``tokens``: the same rows on both sides)."""
    from tests.tolerance import assert_steps_within_rounding

    assert [m["step"] for m in got] == [m["step"] for m in ref], what
    if tokens:
        assert [m.get("tokens") for m in got] == [m.get("tokens") for m in ref], what

    def steps(metrics: list[dict]) -> list[tuple[float, float]]:
        return [(m["loss"], m["grad_norm"]) for m in metrics]

    assert_steps_within_rounding(steps(got), steps(ref), steps(witness), what)
