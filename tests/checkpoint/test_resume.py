"""Exact resume, single process: 6 uninterrupted steps == 3 steps, save, a fresh process loads and does 3 more.

The model has attention dropout, so the RNG states must be restored for the losses to match; AdamW's step counts
and the warmup/cosine scheduler's position must be too. Everything is compared bitwise.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.checkpoint.common import SAVE_AT, TOTAL_STEPS, batch, build, full_params, train
from tests.dist_utils import run_distributed

CONFIG = {"attention_dropout": 0.1}


def _resume(rank: int, world_size: int, root: Path) -> dict:
    """A new process without a process group: scrambled RNG, differently initialised model, then load."""
    torch.manual_seed(4321)
    random.seed(4321)
    _, model, optimizer, scheduler = build(seed=77, **CONFIG)
    extra = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
    losses = train(model, optimizer, scheduler, extra["step"], TOTAL_STEPS)
    return {
        "extra": extra,
        "losses": losses,
        "params": full_params(model),
        "lr": scheduler.get_last_lr(),
        "python_random": random.random(),
    }


def test_exact_resume_single_process(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the resuming process: same kernels, same reduction order
    try:
        with torch.random.fork_rng(devices=[]):
            _, probe, _, _ = build(**CONFIG)
            with torch.no_grad():  # the dropout is live, so the RNG matters
                assert not torch.equal(probe(**batch(0)).loss, probe(**batch(0)).loss)

            _, model, optimizer, scheduler = build(**CONFIG)
            losses = train(model, optimizer, scheduler, 0, SAVE_AT)
            random.seed(5)
            save_checkpoint(tmp_path, SAVE_AT, model, optimizer, scheduler, extra={"step": SAVE_AT, "seen": 90})
            python_random = random.random()
            losses += train(model, optimizer, scheduler, SAVE_AT, TOTAL_STEPS)
            params, lr = full_params(model), scheduler.get_last_lr()
    finally:
        torch.set_num_threads(threads)

    (resumed,) = run_distributed(_resume, 1, tmp_path, init_group=False, timeout=120)
    assert resumed["extra"] == {"step": SAVE_AT, "seen": 90}
    assert resumed["python_random"] == python_random
    assert resumed["lr"] == lr
    assert len(resumed["losses"]) == TOTAL_STEPS - SAVE_AT
    for got, want in zip(resumed["losses"], losses[SAVE_AT:], strict=True):
        assert torch.equal(got, want), (got, want)
    assert resumed["params"].keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(resumed["params"][name], value), name
