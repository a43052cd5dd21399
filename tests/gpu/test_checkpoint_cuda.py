"""Save and exact resume on CUDA (``runtime.checkpoint``): a tiny generated LM with live dropout and a tiny Wan DiT
trained on noise drawn from the CUDA generator, so the CUDA RNG state is part of what must come back. Resumed in
the same process from a differently seeded model and scrambled RNGs: the later steps' losses and the final
parameters bitwise those of the run that never stopped (deterministic kernels)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.gpu.common import CUDA, deterministic, on

pytestmark = pytest.mark.gpu

SAVE_AT, TOTAL = 2, 4


def _lm(seed: int) -> tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    from tests.checkpoint.common import batch
    from tests.parity.dense import models

    _, model = models("qwen3", seed=seed, attention_dropout=0.1)  # the dropout draws from the CUDA generator
    return model.to(CUDA), lambda step: model(**on(batch(step))).loss


def _dit(seed: int) -> tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    from tests.dit.cases import CASES, inputs, shell

    case = CASES["wan"]
    model = shell(case, seed=seed).to(CUDA)

    def loss(step: int) -> torch.Tensor:
        kwargs = on(inputs(case, seed=step))
        noisy = kwargs["hidden_states"] + torch.randn_like(kwargs["hidden_states"])  # the CUDA generator
        return model(**{**kwargs, "hidden_states": noisy})[0].float().square().mean()

    return model, loss


def _optim(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))


def _train(model, loss_of, optimizer, scheduler, start: int, stop: int) -> list[torch.Tensor]:
    model.train()
    losses = []
    for step in range(start, stop):
        loss = loss_of(step)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


@pytest.mark.parametrize("build", [_lm, _dit], ids=["lm", "dit"])
def test_save_and_exact_resume_on_cuda(build, tmp_path: Path) -> None:
    with deterministic(), torch.random.fork_rng(devices=[CUDA] if CUDA.type == "cuda" else []):
        torch.manual_seed(0)
        model, loss_of = build(0)
        optimizer, scheduler = _optim(model)
        losses = _train(model, loss_of, optimizer, scheduler, 0, SAVE_AT)
        save_checkpoint(tmp_path, SAVE_AT, model, optimizer, scheduler, extra={"step": SAVE_AT})
        losses += _train(model, loss_of, optimizer, scheduler, SAVE_AT, TOTAL)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}

        torch.manual_seed(4321)  # scrambled: only the checkpoint's RNG states can give the same draws
        random.seed(4321)
        resumed, loss_of = build(77)
        optimizer, scheduler = _optim(resumed)
        extra = load_checkpoint(latest_checkpoint(tmp_path), resumed, optimizer, scheduler)
        assert extra == {"step": SAVE_AT}
        again = _train(resumed, loss_of, optimizer, scheduler, SAVE_AT, TOTAL)
    assert next(resumed.parameters()).device.type == CUDA.type
    for got, want in zip(again, losses[SAVE_AT:], strict=True):
        assert torch.equal(got, want), (got, want)
    for name, p in resumed.named_parameters():
        assert torch.equal(p, params[name]), name
