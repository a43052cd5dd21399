"""``optim.name`` and ``optim.lr_scheduler_type``: the trainer's optimizer and schedule are the libraries' own.

References are built in the test straight from torch / transformers (the named schedule functions, the optimizer
classes with the documented arguments), never through ``runtime/train/optim.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from runtime.config.common import OPTIMIZERS, SCHEDULERS, OptimConfig
from runtime.config.errors import ConfigError
from runtime.train.optim import build_optimizer, build_scheduler
from tests.dist_utils import run_distributed
from tests.train.common import run_config

STEPS, WARMUP, MIN_LR_RATIO, LR = 12, 3, 0.2, 1e-2


def _reference_scheduler(name: str, optimizer: torch.optim.Optimizer):
    """transformers' schedule of ``name``, built with its own function (not get_scheduler)."""
    if name == "cosine_with_min_lr":
        return transformers.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, WARMUP, STEPS, min_lr_rate=MIN_LR_RATIO
        )
    if name == "cosine":
        return transformers.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)
    if name == "linear":
        return transformers.get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    if name == "constant":
        return transformers.get_constant_schedule(optimizer)
    assert name == "constant_with_warmup"
    return transformers.get_constant_schedule_with_warmup(optimizer, WARMUP)


def _lrs(scheduler, optimizer) -> list[float]:
    """The lr each of STEPS optimizer steps runs with (read before the step, as the trainer logs it)."""
    out = []
    for _ in range(STEPS):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", SCHEDULERS)
def test_schedule_is_transformers_one(name: str) -> None:
    config = OptimConfig(lr=LR, warmup_steps=WARMUP, min_lr_ratio=MIN_LR_RATIO, lr_scheduler_type=name)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    ours = _lrs(build_scheduler(ours_opt, config, STEPS), ours_opt)
    ref = _lrs(_reference_scheduler(name, ref_opt), ref_opt)
    assert ours == ref, (name, ours, ref)
    if name != "constant":  # transformers' warmup: step s of the warmup runs at s / warmup_steps of lr, from 0
        assert ours[:WARMUP] == pytest.approx([LR * s / WARMUP for s in range(WARMUP)], abs=1e-12)


def test_cosine_with_min_lr_ends_at_the_ratio() -> None:
    """transformers reaches ``min_lr_ratio * lr`` at step index ``train.steps`` (one after the last step): the last
    step runs just above it, the whole run within [ratio * lr, lr]."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = build_scheduler(opt, OptimConfig(lr=LR, warmup_steps=0, min_lr_ratio=MIN_LR_RATIO), STEPS)
    lrs = _lrs(scheduler, opt)
    assert lrs[0] == LR and all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    last = MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * (STEPS - 1) / STEPS))
    assert lrs[-1] == pytest.approx(LR * last, rel=1e-12) and lrs[-1] > MIN_LR_RATIO * LR
    assert scheduler.get_last_lr()[0] == pytest.approx(MIN_LR_RATIO * LR, rel=1e-12)


def _reference_optimizer(name: str, params, o: OptimConfig) -> torch.optim.Optimizer:
    """The documented mapping, written out against the libraries."""
    if name == "adamw_torch":
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    if name == "adamw_torch_fused":
        return torch.optim.AdamW(
            params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=True
        )
    if name == "adafactor":
        return transformers.Adafactor(
            params, lr=o.lr, weight_decay=o.weight_decay, relative_step=False, scale_parameter=False
        )
    assert name == "sgd"
    return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_is_the_library_one(name: str) -> None:
    """Three steps of ``build_optimizer`` equal three of the library optimizer built directly: same parameters and
    state, bit for bit; AdamW fused only when asked."""
    o = OptimConfig(lr=1e-2, weight_decay=0.1, betas=[0.8, 0.9], eps=1e-7, name=name)
    torch.manual_seed(0)
    ours_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref_model.load_state_dict(ours_model.state_dict())
    ours, ref = build_optimizer(ours_model.parameters(), o), _reference_optimizer(name, ref_model.parameters(), o)
    assert type(ours) is type(ref)
    if isinstance(ours, torch.optim.AdamW):
        assert ours.defaults["fused"] is (True if name == "adamw_torch_fused" else None)
    x = torch.randn(4, 6)
    for _ in range(3):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(ours.state.values(), ref.state.values(), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (name, key)
    assert ours.param_groups[0]["lr"] == o.lr


def test_fused_is_refused_in_one_line_without_a_kernel() -> None:
    """A device torch has no fused AdamW for (the meta device here): refused when the optimizer is built, not with a
    traceback at the first step."""
    with pytest.raises(ConfigError) as info:
        build_optimizer([torch.nn.Parameter(torch.zeros(2, device="meta"))], OptimConfig(name="adamw_torch_fused"))
    message = str(info.value)
    assert message.startswith("optim.name: adamw_torch_fused") and "meta" in message and "adamw_torch" in message
    assert "\n" not in message


def _adafactor_on_a_dtensor(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    try:
        build_optimizer([param], OptimConfig(name="adafactor"))
    except ConfigError as exc:
        return str(exc)
    return "built"


@pytest.mark.dist
def test_adafactor_is_refused_for_sharded_parameters() -> None:
    """transformers' Adafactor fails on FSDP2's DTensor gradients mid-step ("mixed torch.Tensor and DTensor"): refused
    when the optimizer is built, in one line."""
    (message,) = run_distributed(_adafactor_on_a_dtensor, 1)
    assert message.startswith("optim.name: adafactor") and "adamw_torch" in message and "\n" not in message


def test_non_finite_lr_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^optim\.lr: inf is not a finite number$"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(lr=float("inf")))


@pytest.mark.parametrize(
    ("name", "scheduler"), [("sgd", "linear"), ("adamw_torch_fused", "constant_with_warmup"), ("adafactor", "cosine")]
)
def test_trainer_steps_with_the_named_optimizer_and_schedule(tmp_path: Path, name: str, scheduler: str) -> None:
    """``run_job`` on the tiny text model for 4 steps against the same job stepped by hand with the library optimizer
    and schedule built in the test: identical losses, learning rates and final parameters."""
    from runtime.parallel.fsdp import clip_grad_norm_
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import build_text_job, run_job, setup_parallel
    from runtime.train.preflight import check_inputs

    raw = run_config(
        tmp_path, optim={"name": name, "lr_scheduler_type": scheduler, "warmup_steps": 2}, train={"steps": 4}
    )
    config = parse_config(raw)

    def job():
        state = setup_parallel(config)
        torch.manual_seed(config.model.seed)
        return build_text_job(config, state, check_inputs(config, state)), state

    with torch.random.fork_rng(devices=[]):
        try:
            trained, state = job()
            result = run_job(trained, config, state)
            by_hand, _ = job()
            model = by_hand.model
            model.train()
            optimizer = _reference_optimizer(name, [p for p in model.parameters() if p.requires_grad], config.optim)
            schedule = {
                "linear": transformers.get_linear_schedule_with_warmup,
                "constant_with_warmup": lambda opt, w, _: transformers.get_constant_schedule_with_warmup(opt, w),
                "cosine": transformers.get_cosine_schedule_with_warmup,
            }[scheduler](optimizer, 2, 4)
            losses, lrs = [], []
            for step in range(1, 5):
                work = by_hand.forward_backward(step)
                clip_grad_norm_(model.parameters(), config.optim.max_grad_norm)
                losses.append(work.loss.item())
                lrs.append(schedule.get_last_lr()[0])
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
        finally:
            set_parallel_state(None)
    assert [m.loss for m in result.metrics] == losses
    assert [m.lr for m in result.metrics] == lrs and lrs[0] == 0.0
    for a, b in zip(result.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
