"""The offline iteration of an algorithm that trains on preference pairs (``data == "pairs"``: Diffusion-DPO,
``runtime/rl/algorithms/dpo.py`` states the objective), called by the loop like the rollout trainers: this
replica's preference pairs, their latents (images, or a video model's first ``sampling.frames`` frames), one
``(t, eps)`` per pair shared by its two images, the policy's and the frozen reference's velocities, and one
``update`` (``runtime/rl/update.py``: clipping, the non-finite guard, the EMA, the policy-moved check). No rollout,
no reward.

Draws. ``(t, eps)`` of global pair ``q = dp_rank * B + i`` at iteration ``k`` come from
``runtime/rl/sampling/forward.forward_draws`` (a generator seeded by ``(model.seed, k, q)`` alone, the forward-process
algorithms' one way to draw): the SP ranks of a replica draw alike, ``D`` replicas draw what one process with ``D``
times the pairs draws, and a resumed run draws what the uninterrupted run drew.

Gradients. Each micro-batch's loss is its share of the global batch mean (``len(rows) / (B * D)``), as in the
rollout trainers (``update.py``); FSDP2 sums over ranks, SP ranks' partial gradients add up to the single-process ones.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runtime.kernels.timing import Clock
from runtime.rl.batch import select_rows
from runtime.rl.pairs import encode_media
from runtime.rl.policy import lora_disabled
from runtime.rl.replicas import replica_mean
from runtime.rl.run_state import RLRun
from runtime.rl.sampling.forward import forward_draws, noised
from runtime.rl.sampling.scheduler import FlowMatchSchedule
from runtime.rl.update import StepLosses, update

__all__ = ["offline_iteration", "velocity_at"]


def velocity_at(adapter: Any, module: Any, batch: dict, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``module``'s velocity at ``x_t`` with per-sample times ``t`` (a one-step schedule per sample)."""
    sigmas = torch.cat([t, torch.zeros(1)]).float()
    schedule = FlowMatchSchedule(sigmas, sigmas[:-1] * 1000, 1000).to(xt.device)
    return adapter.velocity(module, {**batch, "schedule": schedule}, xt, torch.arange(len(t), device=xt.device))


def _reference_velocity(run: RLRun, batch: dict, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The frozen reference's velocity: the configured frozen copy, or the policy with its LoRA off."""
    policy = run.policy
    with torch.no_grad():
        if policy.reference is not None:
            return velocity_at(policy.adapter, policy.reference, batch, xt, t)
        with lora_disabled(policy.module) as ref:
            return velocity_at(policy.adapter, ref, batch, xt, t)


def _latents(run: RLRun, pairs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and the rejected images' (videos') latents ``[B, ...]`` at the configured size (and frame count).

    Each medium is encoded once per run and kept (``run.latent_cache``), as the DiT trainer's condition cache keeps
    its latents: the encoding is deterministic (the VAE's mode), so a cached latent is bitwise the one a new encoding
    gives, and later epochs skip the VAE. A rank keeps only its own replica's pairs' latents."""
    s, cm = run.config.sampling, run.policy.adapter.condition_model

    def encoded(path: Any, where: str) -> torch.Tensor:
        key = (str(path), s.height, s.width, s.frames)
        if key not in run.latent_cache:
            run.latent_cache[key] = encode_media(cm, [path], [where], s.height, s.width, s.frames)[0]
        return run.latent_cache[key]

    chosen = torch.stack([encoded(p.chosen, p.where) for p in pairs])
    rejected = torch.stack([encoded(p.rejected, p.where) for p in pairs])
    return chosen, rejected


def offline_iteration(run: RLRun, step: int) -> dict[str, Any]:
    """Iteration ``step`` (1-based) of a pair-trained algorithm: one optimizer update on this replica's pairs; its
    metrics. The loss is the algorithm's ``pair_objective`` (the contract, ``runtime/rl/algorithms/base.py``)."""
    c, s, state, policy = run.config, run.config.algo, run.state, run.policy
    module, adapter, algo = policy.module, policy.adapter, run.algo
    cpu = Clock()
    started, cpu_started = time.perf_counter(), cpu.now()
    pairs = [run.prompts[i] for i in next(run.sampler)]
    b = len(pairs)
    batch = adapter.encode([p.text for p in pairs], c.data.negative_prompt)
    x_w, x_l = _latents(run, pairs)
    device = x_w.device
    u, eps = forward_draws(c.model.seed, step, 0, state.dp_rank * b, b, x_w.shape[1:])
    t_all, eps = s.t_min + (s.t_max - s.t_min) * u, eps.to(device=device, dtype=x_w.dtype)
    mb = s.micro_batch_size or b
    share = 1.0 / (b * state.dp_size)
    lr = run.optimizer.param_groups[0]["lr"]
    stats: dict[str, float] = {}
    losses = StepLosses()
    run.optimizer.zero_grad(set_to_none=True)
    module.train()
    for start in range(0, b, mb):
        rows = torch.arange(start, min(start + mb, b))
        sub, t = select_rows(batch, rows), t_all[rows]
        xt_w, target_w = noised(x_w[rows], eps[rows], t.to(device))
        xt_l, target_l = noised(x_l[rows], eps[rows], t.to(device))
        v_w, v_l = velocity_at(adapter, module, sub, xt_w, t), velocity_at(adapter, module, sub, xt_l, t)
        ref_w, ref_l = _reference_velocity(run, sub, xt_w, t), _reference_velocity(run, sub, xt_l, t)
        loss, step_stats = algo.pair_objective(
            s, v_w, v_l, ref_w, ref_l, target_w.to(v_w.dtype), target_l.to(v_l.dtype)
        )
        losses.backward(loss, len(rows) * share, step, [pairs[r].where for r in rows.tolist()])
        for key, value in step_stats.items():  # pair-weighted: the batch mean whatever the micro-batch sizes
            stats[key] = stats.get(key, 0.0) + float(value) * len(rows) / b
    norm, _ = update(
        run,
        policy.trainable,
        f"step {step}",
        losses,
        check_moved=True,
        signal=lambda: True,  # a preference pair always pulls (the loss's gradient is never 0 at d = 0)
        unmoved=f"step {step}: the update changed no trainable parameter",
    )
    module.eval()
    run.scheduler.step()
    metrics: dict[str, Any] = {"step": step}
    metrics.update({key: replica_mean(value, state) for key, value in stats.items()})
    metrics.update(
        grad_norm=norm,
        lr=lr,
        logprob_gap_alarm=0,  # the job's log-prob guard: DPO computes no log-prob
        skipped_nonfinite=run.skipped_nonfinite,
        wall_time_train=time.perf_counter() - started,
        cpu_time_train=cpu.now() - cpu_started,
    )
    return metrics
