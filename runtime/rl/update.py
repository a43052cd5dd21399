"""The training side of an RL iteration, shared by every algorithm: the objective recomputed with grad over the
rollout's window steps (``train_steps``) or, for forward-process algorithms, over the rollout's clean samples
(``train_forward``), each inner epoch ending in one optimizer ``update`` (clipping, the non-finite guard, the step,
the EMA, the policy-moved check; the offline pair trainer, ``offline.py``, calls it too).

Gradients. Each replica's loss is its share of the global mean (``runtime/rl/algorithms/flowgrpo.py``); FSDP2 sums
gradients over every rank (``apply_fsdp``), SP ranks' partial gradients add up to the single-process ones.

The policy cannot or did not change: a loss that depends on no trainable parameter (the trained modules are not on
the forward's path), or an applied update with a non-zero advantage that leaves every trainable parameter unchanged
(a learning rate too small for float32 weights, gradients that do not reach them), stops the run
(``PolicyUnchangedError``). An iteration whose advantages are all 0 (equal rewards in every group) has nothing to
learn and is not an error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from runtime.config.errors import ConfigError
from runtime.parallel.fsdp import clip_grad_norm_
from runtime.rl.batch import select_rows
from runtime.rl.policy import lora_disabled
from runtime.rl.replicas import gather, replica_mean
from runtime.rl.rollout_correction import correction, weighted_objective
from runtime.rl.sequence_ratio import sequence_log_ratios
from runtime.train.finite import guard_update, micro_batches

if TYPE_CHECKING:
    from runtime.rl.algorithms.base import ReferenceTerms
    from runtime.rl.run_state import RLRun
    from runtime.rl.sampling.rollout import RolloutResult

__all__ = ["PolicyUnchangedError", "StepLosses", "train_forward", "train_steps", "update"]


class PolicyUnchangedError(ConfigError):
    """An applied update changed no trainable parameter although the advantages were not all 0."""


def _fingerprint(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum and sum of squares of this rank's share of ``params`` (float64): an update that moves any of them moves
    one of the two (a parameter at 0, LoRA's B, moves the squares)."""
    out = torch.zeros(2, dtype=torch.float64)
    for p in params:
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        x = local.double()
        out += torch.stack([x.sum(), x.square().sum()]).cpu()
    return out


def _changed_anywhere(before: torch.Tensor, after: torch.Tensor) -> bool:
    flag = torch.tensor([float(not torch.equal(before, after))])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _reference_term(
    run: RLRun,
    batch: dict,
    x: torch.Tensor,
    step_index: torch.Tensor,
    prev: torch.Tensor,
    levels: torch.Tensor,
    terms: ReferenceTerms = "mean",
) -> torch.Tensor:
    """The frozen reference's step mean (or velocity, ``terms``) at ``x``: the separate reference (a frozen copy, or
    a distillation teacher), or the policy with its LoRA disabled."""
    policy = run.policy
    with torch.no_grad(), contextlib.ExitStack() as stack:
        ref = policy.reference
        if ref is None:
            ref = stack.enter_context(lora_disabled(policy.module))
        if terms == "velocity":
            return policy.adapter.velocity(ref, batch, x, step_index)
        out = policy.adapter.forward_and_sample_previous_step(
            ref, batch, x, step_index, prev_sample=prev, noise_level=levels
        )
    return out[1]


@dataclass
class StepLosses:
    """The micro-batch losses of one update, as the update needs them: their float64 sum (the non-finite guard's
    input) and each one with the samples it came from (the guard's message names them)."""

    total: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    losses: list[torch.Tensor] = field(default_factory=list)
    names: list[list[str]] = field(default_factory=list)

    def backward(self, loss: torch.Tensor, weight: float, step: int, names: list[str]) -> None:
        """Backpropagate one micro-batch's ``loss x weight`` (its share of the step's mean) and record it; refused in
        one line when no trained parameter is on the loss's path (no update could change the policy)."""
        scaled = loss * weight
        if not scaled.requires_grad:
            raise PolicyUnchangedError(
                f"step {step}: the loss depends on no trainable parameter, so no update can change the "
                f"policy: the trained modules are not on the forward's path (check lora.target_modules)"
            )
        scaled.backward()
        self.total += scaled.detach().double().cpu()
        self.losses.append(scaled.detach())
        self.names.append(names)

    def sources(self) -> Any:
        return micro_batches(self.losses, self.names)


def update(
    run: RLRun,
    params: list[torch.Tensor],
    where: str,
    losses: StepLosses,
    *,
    check_moved: bool,
    signal: Callable[[], bool],
    unmoved: str,
) -> tuple[float, bool]:
    """One optimizer update of an inner epoch, shared by every algorithm: clipping, the non-finite guard (a skipped
    step is counted), the step and the EMA; with ``check_moved`` (the iteration's first applied update), an update
    with a learning ``signal`` (collective: every rank calls it) that moved no parameter stops the run. Returns
    (the gradient norm, whether the update was applied)."""
    c = run.config
    norm = clip_grad_norm_(params, c.optim.max_grad_norm or math.inf)
    if not guard_update(
        where, losses.total.float(), norm, run.optimizer, mode=c.train.nonfinite, sources=losses.sources
    ):
        run.skipped_nonfinite += 1
        return float(norm), False
    before = _fingerprint(params) if check_moved else None
    run.optimizer.step()
    if run.policy.ema is not None:
        run.policy.ema.update()
    if before is not None:
        has_signal = signal()
        lr = run.optimizer.param_groups[0]["lr"]
        if has_signal and lr > 0 and not _changed_anywhere(before, _fingerprint(params)):
            raise PolicyUnchangedError(
                f"{unmoved} (gradient norm {float(norm):.3g}, lr {lr:.3g}): a learning rate too small to move float32 "
                f"weights, or gradients that do not reach them (check optim.lr and lora.target_modules)"
            )
    return float(norm), True


def _sequence(seq: torch.Tensor | None, rows: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """``step_objective``'s ``seq_log_ratio`` of ``rows``, only for an algorithm that takes it."""
    return {} if seq is None else {"seq_log_ratio": seq[rows].to(device)}


def train_steps(
    run: RLRun, step: int, res: RolloutResult, batch: dict, advantages: torch.Tensor, names: list[str]
) -> dict[str, Any]:
    """Every inner epoch's optimizer step on the rollout ``res``; the statistics of the iteration."""
    c, s, state, policy = run.config, run.config.algo, run.state, run.policy
    module, adapter = policy.module, policy.adapter
    b, w = res.latents.shape[0], res.step_indices.shape[1]
    mb = s.micro_batch_size or b
    device = res.final_latents.device
    train_batch = {**batch, "schedule": res.schedule.to(device)}
    params = policy.trainable
    # the window positions each sample trains on ([B, K]; DanceGRPO subsamples them), or all W in order
    positions = run.algo.train_positions(s, w, c.model.seed, step, state.dp_rank * b, b)
    k = w if positions is None else positions.shape[1]
    share = 1.0 / (b * k * state.dp_size)
    stats: dict[str, list[float]] = {}
    gaps: list[torch.Tensor] = []
    grad_norms, changed_checked = [], False
    # the policy's step means before this iteration's first update (algorithms whose objective reads them)
    old_means: list[torch.Tensor | None] | None = [None] * w if run.algo.needs_old_mean else None
    # what the objective compares with the frozen reference (a KL's step means, a teacher's velocities), or nothing
    terms = run.algo.reference_terms(s) if run.algo.needs_reference(s) else None
    module.train()
    # rollout correction (verl's decoupled mode): the old policy's log-probs anchor the ratio and weight the rows
    corrected = _rollout_correction(run, res, train_batch, positions, k, mb) if c.rollout_correction.enabled else None
    for epoch in range(s.inner_epochs):
        order = torch.arange(b)
        if epoch > 0:  # later epochs shuffle the samples (seeded: a resumed run shuffles alike)
            order = torch.randperm(b, generator=torch.Generator().manual_seed(c.model.seed * 7919 + step * 31 + epoch))
        run.optimizer.zero_grad(set_to_none=True)
        losses = StepLosses()
        # GSPO: each sample's log-ratio over all its trained steps, under this epoch's weights (sequence_ratio.py),
        # against the old log-probs the per-step ratio takes (the rollout's, or rollout correction's old policy's)
        seq = None
        if run.algo.needs_sequence_ratio(s):
            anchor = None if corrected is None else corrected[0]
            seq = sequence_log_ratios(run, res, train_batch, order, positions, k, mb, anchor)
        for j in range(k):
            for start in range(0, b, mb):
                rows = order[start : start + mb]
                sub = select_rows(train_batch, rows)
                col = j if positions is None else positions[rows, j]
                x, prev = res.latents[rows, col].to(device), res.latents[rows, col + 1].to(device)
                step_index = res.step_indices[rows, col].to(device)
                levels = torch.full((len(rows),), float(s.noise_level), device=device)
                # compared velocities: the step below is taken from the same forward's velocity
                v = adapter.velocity(module, sub, x, step_index) if terms == "velocity" else None
                log_prob, mean, std_dev_t, sqrt_dt = adapter.forward_and_sample_previous_step(
                    module, sub, x, step_index, prev_sample=prev, noise_level=levels, velocity=v
                )
                old = res.log_probs[rows, col].to(log_prob.device)
                if epoch == 0:
                    gaps.append((log_prob.detach() - old).abs().cpu())
                kl_terms = None
                if terms is not None:
                    ref = _reference_term(run, sub, x, step_index, prev, levels, terms)
                    kl_terms = (mean if v is None else v, ref, std_dev_t, sqrt_dt)
                gaussian = None
                if old_means is not None:
                    if epoch == 0:  # the policy has not moved yet: these are the old policy's means
                        if old_means[j] is None:
                            old_means[j] = torch.empty((b, *mean.shape[1:]), dtype=mean.dtype, device=mean.device)
                        old_means[j][rows.to(mean.device)] = mean.detach()
                    gaussian = (mean, old_means[j][rows.to(mean.device)], std_dev_t, sqrt_dt)
                if corrected is None:
                    loss, step_stats = run.algo.step_objective(
                        s,
                        log_prob,
                        old,
                        advantages[rows].to(device),
                        kl_terms,
                        gaussian,
                        **_sequence(seq, rows, device),
                    )
                else:
                    old = corrected[0][rows, j].to(log_prob.device)
                    loss, step_stats = weighted_objective(
                        run.algo,
                        s,
                        corrected[1][rows, j],
                        log_prob,
                        old,
                        advantages[rows].to(device),
                        kl_terms,
                        gaussian,
                        **_sequence(seq, rows, device),
                        weighted_terms=c.rollout_correction.weighted_terms,
                    )
                losses.backward(loss, len(rows) * share, step, [names[r] for r in rows.tolist()])
                step_stats["ratio_mean"] = torch.exp(log_prob.detach() - old).mean()
                for key, value in step_stats.items():
                    stats.setdefault(key, []).append(float(value))
        norm, applied = update(
            run,
            params,
            f"step {step} (inner epoch {epoch})",
            losses,
            check_moved=not changed_checked,
            signal=lambda: bool(gather(advantages[None].abs().max().reshape(1, 1), state).max() > 0),
            unmoved=f"step {step}: the update changed no trainable parameter although the advantages were not all 0",
        )
        grad_norms.append(norm)
        changed_checked = changed_checked or applied
    module.eval()
    out = {k: replica_mean(sum(v) / len(v), state) for k, v in stats.items()}
    gap = torch.cat(gaps)
    out["logprob_gap_mean"] = replica_mean(gap.mean().item(), state)
    out["logprob_gap_max"] = replica_mean(gap.max().item(), state, "max")
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    if corrected is not None:
        out.update(corrected[2])
    return out


def _rollout_correction(
    run: RLRun, res: RolloutResult, train_batch: dict, positions: torch.Tensor | None, k: int, mb: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The old policy's log-probs ``[B, K]`` of the trained steps (no grad, before any update, in the first epoch's
    layout: bitwise its forward's), the rows' weights ``[B, K]`` and the ``rollout_corr/`` metrics of the global batch
    (``rollout_correction.py``)."""
    s, state, adapter, module = run.config.algo, run.state, run.policy.adapter, run.policy.module
    b, device = res.latents.shape[0], res.final_latents.device
    old = torch.empty((b, k), dtype=res.log_probs.dtype)
    rollout = torch.empty((b, k), dtype=res.log_probs.dtype)
    with torch.no_grad():
        for j in range(k):
            for start in range(0, b, mb):
                rows = torch.arange(start, min(start + mb, b))
                col = j if positions is None else positions[rows, j]
                x, prev = res.latents[rows, col].to(device), res.latents[rows, col + 1].to(device)
                levels = torch.full((len(rows),), float(s.noise_level), device=device)
                log_prob = adapter.forward_and_sample_previous_step(
                    module,
                    select_rows(train_batch, rows),
                    x,
                    res.step_indices[rows, col].to(device),
                    prev_sample=prev,
                    noise_level=levels,
                )[0]
                old[rows, j] = log_prob.detach().cpu().to(old.dtype)
                rollout[rows, j] = res.log_probs[rows, col].cpu()
    every_old, every_rollout = (gather(t.T.contiguous(), state).T for t in (old, rollout))  # [D * B, K]
    weights, metrics = correction(every_old, every_rollout, run.config.rollout_correction)
    return old, weights[state.dp_rank * b : (state.dp_rank + 1) * b], metrics


def train_forward(
    run: RLRun, step: int, res: RolloutResult, batch: dict, weights: torch.Tensor, names: list[str]
) -> dict[str, Any]:
    """Every inner epoch's optimizer step of a forward-process algorithm on the rollout's clean samples: per sample
    and draw, a seeded ``(t, eps)``, ``x_t`` and its target velocity; the module's ``objective`` on the trained and
    the old velocity (the first epoch's, before any update)."""
    from runtime.rl.sampling.forward import forward_draws, noised
    from runtime.rl.sampling.scheduler import FlowMatchSchedule

    c, s, state, policy = run.config, run.config.algo, run.state, run.policy
    module, adapter, algo = policy.module, policy.adapter, run.algo
    x0 = res.final_latents
    b, k, device = x0.shape[0], s.timesteps_per_sample, x0.device
    mb = s.micro_batch_size or b
    share = 1.0 / (b * k * state.dp_size)
    params = policy.trainable
    draws = []
    for j in range(k):
        u, eps = forward_draws(c.model.seed, step, j, state.dp_rank * b, b, x0.shape[1:])
        draws.append((s.t_min + (s.t_max - s.t_min) * u, eps.to(device=device, dtype=x0.dtype)))
    old_v: list[torch.Tensor | None] = [None] * k
    stats: dict[str, list[float]] = {}
    grad_norms, changed_checked = [], False
    module.train()
    for epoch in range(s.inner_epochs):
        order = torch.arange(b)
        if epoch > 0:
            order = torch.randperm(b, generator=torch.Generator().manual_seed(c.model.seed * 7919 + step * 31 + epoch))
        run.optimizer.zero_grad(set_to_none=True)
        losses = StepLosses()
        for j, (t_all, eps_all) in enumerate(draws):
            for start in range(0, b, mb):
                rows = order[start : start + mb]
                t = t_all[rows]
                sigmas = torch.cat([t, torch.zeros(1)]).float()
                schedule = FlowMatchSchedule(sigmas, sigmas[:-1] * 1000, 1000)
                sub = {**select_rows(batch, rows), "schedule": schedule.to(device)}
                xt, target = noised(x0[rows], eps_all[rows.to(device)], t.to(device))
                v = adapter.velocity(module, sub, xt, torch.arange(len(rows), device=device))
                if epoch == 0:
                    if old_v[j] is None:
                        old_v[j] = torch.empty((b, *v.shape[1:]), dtype=v.dtype, device=v.device)
                    old_v[j][rows.to(v.device)] = v.detach()
                loss, step_stats = algo.forward_objective(
                    s, v, old_v[j][rows.to(v.device)], target.to(v.dtype), weights[rows].to(v.device), t.to(v.device)
                )
                losses.backward(loss, len(rows) * share, step, [names[r] for r in rows.tolist()])
                for key, value in step_stats.items():
                    stats.setdefault(key, []).append(float(value))
        norm, applied = update(
            run,
            params,
            f"step {step} (inner epoch {epoch})",
            losses,
            check_moved=not changed_checked,
            signal=lambda: bool(gather((weights - 0.5).abs().max().reshape(1, 1).double(), state).max() > 0),
            unmoved=f"step {step}: the update changed no trainable parameter",
        )
        grad_norms.append(norm)
        changed_checked = changed_checked or applied
    module.eval()
    out = {key: replica_mean(sum(v) / len(v), state) for key, v in stats.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out
