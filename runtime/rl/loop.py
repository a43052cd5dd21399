"""The RL loop shared by the algorithms: per iteration, this replica's prompts, a rollout of ``group_size`` samples
each under the current policy (no grad), their rewards, the algorithm's advantages over the global batch, and its
objective recomputed with grad over the rollout's window steps; then the guards, AdamW, metrics, checkpoints.

Seeds. Sample ``i`` of replica ``r`` at iteration ``k`` is global sample ``q = r * B + i`` and gets its own
``torch.Generator`` seeded from ``(model.seed, k, q)`` alone: it draws the sample's window start, its initial noise
and its SDE noise (``runtime/flowgrpo/rollout.py``). So the SP ranks of a replica roll out identical samples (same
prompts: ``PromptSampler`` reads only the replica), ``D`` replicas roll out, sample for sample, what one process with
``D`` times the prompts rolls out, and a run resumed at iteration ``k`` draws exactly what the uninterrupted run drew
(the per-sample seeds are a function of the step and the data position, both checkpointed).

Gradients. Each replica's loss is its share of the global mean (``runtime/rl/algorithms/flowgrpo.py``); FSDP2 sums
gradients over every rank (``apply_fsdp``), SP ranks' partial gradients add up to the single-process ones.

Guards (each one line, exit 2 through ``python -m runtime.rl``):

* non-finite loss, gradient norm or learning rate: ``runtime/train/finite.py`` (``train.nonfinite``: stop | skip);
* the rollout-vs-training log-prob gap: on the first inner step the policy has not moved, so recomputed log-probs
  must equal the rollout's (bitwise in the rollout's batch layout). ``max |dlogp|`` above ``logprob_gap_alarm``
  prints an alarm (``on_logprob_gap: warn``) or stops the run (``stop``): a gap means rollout and training disagree
  on the schedule, the guidance, the weights (a LoRA bound to modules the forward does not run) or the inputs;
* the policy cannot or did not change: a loss that depends on no trainable parameter (the trained modules are not
  on the forward's path), or an applied update with a non-zero advantage that leaves every trainable parameter
  unchanged (a learning rate too small for float32 weights, gradients that do not reach them), stops the run
  (``PolicyUnchangedError``). An iteration whose advantages are all 0 (equal rewards in every group) has nothing
  to learn and is not an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.config.errors import ConfigError
from runtime.flowgrpo.rollout import RolloutResult, rollout
from runtime.flowgrpo.trainer import repeat_batch, select_rows
from runtime.kernels.timing import Clock
from runtime.parallel.fsdp import clip_grad_norm_
from runtime.parallel.state import ParallelState
from runtime.rl.config import RLConfig, algorithm_module
from runtime.rl.metrics import RLMetricsLogger
from runtime.rl.policy import Policy, build_policy, lora_disabled
from runtime.rl.preflight import CheckedRLInputs, check_rl_inputs
from runtime.rl.prompts import Prompt, PromptSampler
from runtime.rl.rewards import RewardError, RewardMix, build_rewards, reward_names
from runtime.train.finite import check_mode, guard_update, micro_batches
from runtime.train.schedule_keys import schedule_record

__all__ = [
    "LogProbGapError",
    "PolicyUnchangedError",
    "RLResult",
    "RLRun",
    "iteration",
    "run_rl",
    "sample_generators",
    "save",
    "start_run",
]


class LogProbGapError(ConfigError):
    """The rollout's and the training side's log-probs disagree on the first inner step (``on_logprob_gap: stop``)."""


class PolicyUnchangedError(ConfigError):
    """An applied update changed no trainable parameter although the advantages were not all 0."""


@dataclass(frozen=True)
class RLResult:
    metrics: list[dict[str, Any]]
    start_step: int  # 0 for a fresh run, k when resumed from the step-k checkpoint
    skipped_checkpoints: list[str] = field(default_factory=list)
    policy: Any = field(default=None, repr=False, compare=False)
    last_rollout: Any = field(default=None, repr=False, compare=False)


def sample_generators(seed: int, step: int, first: int, count: int) -> list[torch.Generator]:
    """The generators of global samples ``first .. first + count - 1`` of iteration ``step``."""
    gens = []
    for index in range(first, first + count):
        digest = hashlib.sha256(f"patchgen.rl.sample:{seed}:{step}:{index}".encode()).digest()
        gens.append(torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)))
    return gens


def concat_rollouts(parts: Sequence[RolloutResult]) -> RolloutResult:
    """The rollouts of consecutive chunks of samples as one (they share the schedule)."""
    if len(parts) == 1:
        return parts[0]
    return RolloutResult(
        *(torch.cat([getattr(p, f) for p in parts]) for f in ("latents", "step_indices", "timesteps", "log_probs")),
        final_latents=torch.cat([p.final_latents for p in parts]),
        schedule=parts[0].schedule,
    )


def _gather(values: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """``values`` ``[K, B]`` of every data-parallel replica, replica-major ``[K, D * B]`` (collective)."""
    if state.dp_size == 1:
        return values
    k, b = values.shape
    parts = torch.empty((state.dp_size * k, b), dtype=values.dtype, device=values.device)
    dist.all_gather_into_tensor(parts, values.contiguous(), group=state.dp_group)
    return parts.view(state.dp_size, k, b).permute(1, 0, 2).reshape(k, -1)


def _replica_mean(value: float, state: ParallelState, op: str = "mean") -> float:
    """A per-replica statistic over the data-parallel replicas (every rank gets it)."""
    if state.dp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=state.dp_group)
    return t.item() if op == "max" else t.item() / state.dp_size


def _attempt(fn: Any, *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, message)`` for a user error (a config or reward error)."""
    try:
        return fn(*args), None
    except ConfigError as exc:
        return None, str(exc)


def agree(error: str | None, state: ParallelState) -> None:
    """Every rank raises the first rank's error when any rank has one (collective): a rank that failed alone must
    not leave the others waiting in the next collective."""
    errors = [error]
    if state.world_size > 1:
        errors = [None] * state.world_size
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise RewardError(first)


def _local_scores(run: RLRun, samples: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor | None, str | None]:
    """This rank's ``[1 + K, n]`` (combined, then each reward) for ``samples``, or the reward's error."""
    try:
        combined, each = run.rewards(samples, prompts)
    except RewardError as exc:
        return None, str(exc)
    return torch.stack([combined, *(each[n] for n in run.reward_names)]).double(), None


def score(run: RLRun, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """The rewards of the global batch, ``[1 + K, D * B]`` replica-major, on every rank (collective).

    ``reward_ranks: null``: every rank scores its replica's samples. A list of ranks: the first SP rank of each
    replica sends its samples there, the listed ranks score contiguous chunks of the global batch in turn, and every
    rank receives all the values (reward models are built and run on those ranks only)."""
    state, ranks = run.state, run.config.reward_ranks
    if ranks is None:
        local, error = _local_scores(run, samples, prompts)
        agree(error, state)
        return _gather(local, state)
    parts: list[Any] = [None] * state.world_size
    mine = (state.dp_rank, samples.detach().cpu(), list(prompts)) if state.sp_rank == 0 else None
    dist.all_gather_object(parts, mine)
    ordered = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    all_samples = torch.cat([p[1] for p in ordered])
    all_prompts = [t for p in ordered for t in p[2]]
    n = len(all_prompts)
    bounds = [n * j // len(ranks) for j in range(len(ranks) + 1)]
    result: tuple[int, torch.Tensor | None, str | None] | None = None
    if state.rank in ranks:
        j = ranks.index(state.rank)
        lo, hi = bounds[j], bounds[j + 1]
        result = (j, *_local_scores(run, all_samples[lo:hi], all_prompts[lo:hi])) if hi > lo else (j, None, None)
    answers: list[Any] = [None] * state.world_size
    dist.all_gather_object(answers, result)
    answers = sorted((a for a in answers if a is not None), key=lambda a: a[0])
    agree(next((a[2] for a in answers if a[2] is not None), None), state)
    return torch.cat([a[1] for a in answers if a[1] is not None], dim=1)


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


@dataclass
class RLRun:
    """Everything an iteration reads and advances."""

    config: RLConfig
    state: ParallelState
    policy: Policy
    rewards: RewardMix | None  # None on ranks that do not score (reward_ranks)
    reward_names: list[str]
    prompts: list[Prompt]
    sampler: PromptSampler
    optimizer: torch.optim.Optimizer
    scheduler: Any
    algo: Any  # the algorithm module
    logger: RLMetricsLogger
    skipped_nonfinite: int = 0


def _reference_mean(run: RLRun, batch, x, step_index, prev, levels) -> torch.Tensor:
    policy = run.policy
    with torch.no_grad():
        if policy.reference is not None:
            ref = policy.reference
            out = policy.adapter.forward_and_sample_previous_step(
                ref, batch, x, step_index, prev_sample=prev, noise_level=levels
            )
        else:
            with lora_disabled(policy.module) as ref:
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


def _update(
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


def _train(
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
    positions = None
    if hasattr(run.algo, "train_positions"):
        positions = run.algo.train_positions(s, w, c.model.seed, step, state.dp_rank * b, b)
    k = w if positions is None else positions.shape[1]
    share = 1.0 / (b * k * state.dp_size)
    stats: dict[str, list[float]] = {}
    gaps: list[torch.Tensor] = []
    grad_norms, changed_checked = [], False
    # the policy's step means before this iteration's first update (algorithms whose objective reads them)
    old_means: list[torch.Tensor | None] | None = [None] * w if getattr(run.algo, "NEEDS_OLD_MEAN", False) else None
    module.train()
    for epoch in range(s.inner_epochs):
        order = torch.arange(b)
        if epoch > 0:  # later epochs shuffle the samples (seeded: a resumed run shuffles alike)
            order = torch.randperm(b, generator=torch.Generator().manual_seed(c.model.seed * 7919 + step * 31 + epoch))
        run.optimizer.zero_grad(set_to_none=True)
        losses = StepLosses()
        for j in range(k):
            for start in range(0, b, mb):
                rows = order[start : start + mb]
                sub = select_rows(train_batch, rows)
                col = j if positions is None else positions[rows, j]
                x, prev = res.latents[rows, col].to(device), res.latents[rows, col + 1].to(device)
                step_index = res.step_indices[rows, col].to(device)
                levels = torch.full((len(rows),), float(s.noise_level), device=device)
                log_prob, mean, std_dev_t, sqrt_dt = adapter.forward_and_sample_previous_step(
                    module, sub, x, step_index, prev_sample=prev, noise_level=levels
                )
                old = res.log_probs[rows, col].to(log_prob.device)
                if epoch == 0:
                    gaps.append((log_prob.detach() - old).abs().cpu())
                kl_terms = None
                if s.kl_coef > 0:
                    ref_mean = _reference_mean(run, sub, x, step_index, prev, levels)
                    kl_terms = (mean, ref_mean, std_dev_t, sqrt_dt)
                extra = {}
                if old_means is not None:
                    if epoch == 0:  # the policy has not moved yet: these are the old policy's means
                        if old_means[j] is None:
                            old_means[j] = torch.empty((b, *mean.shape[1:]), dtype=mean.dtype, device=mean.device)
                        old_means[j][rows.to(mean.device)] = mean.detach()
                    extra["gaussian"] = (mean, old_means[j][rows.to(mean.device)], std_dev_t, sqrt_dt)
                loss, step_stats = run.algo.step_objective(
                    s, log_prob, old, advantages[rows].to(device), kl_terms, **extra
                )
                losses.backward(loss, len(rows) * share, step, [names[r] for r in rows.tolist()])
                step_stats["ratio_mean"] = torch.exp(log_prob.detach() - old).mean()
                for key, value in step_stats.items():
                    stats.setdefault(key, []).append(float(value))
        norm, applied = _update(
            run,
            params,
            f"step {step} (inner epoch {epoch})",
            losses,
            check_moved=not changed_checked,
            signal=lambda: bool(_gather(advantages[None].abs().max().reshape(1, 1), state).max() > 0),
            unmoved=f"step {step}: the update changed no trainable parameter although the advantages were not all 0",
        )
        grad_norms.append(norm)
        changed_checked = changed_checked or applied
    module.eval()
    out = {k: _replica_mean(sum(v) / len(v), state) for k, v in stats.items()}
    gap = torch.cat(gaps)
    out["logprob_gap_mean"] = _replica_mean(gap.mean().item(), state)
    out["logprob_gap_max"] = _replica_mean(gap.max().item(), state, "max")
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def _train_forward(
    run: RLRun, step: int, res: RolloutResult, batch: dict, weights: torch.Tensor, names: list[str]
) -> dict[str, Any]:
    """Every inner epoch's optimizer step of a forward-process algorithm on the rollout's clean samples: per sample
    and draw, a seeded ``(t, eps)``, ``x_t`` and its target velocity; the module's ``objective`` on the trained and
    the old velocity (the first epoch's, before any update)."""
    from runtime.flowgrpo.scheduler import FlowMatchSchedule

    c, s, state, policy = run.config, run.config.algo, run.state, run.policy
    module, adapter, algo = policy.module, policy.adapter, run.algo
    x0 = res.final_latents
    b, k, device = x0.shape[0], s.timesteps_per_sample, x0.device
    mb = s.micro_batch_size or b
    share = 1.0 / (b * k * state.dp_size)
    params = policy.trainable
    draws = []
    for j in range(k):
        u, eps = algo.forward_draws(c.model.seed, step, j, state.dp_rank * b, b, x0.shape[1:])
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
                xt, target = algo.noised(x0[rows], eps_all[rows.to(device)], t.to(device))
                v = adapter.velocity(module, sub, xt, torch.arange(len(rows), device=device))
                if epoch == 0:
                    if old_v[j] is None:
                        old_v[j] = torch.empty((b, *v.shape[1:]), dtype=v.dtype, device=v.device)
                    old_v[j][rows.to(v.device)] = v.detach()
                loss, step_stats = algo.objective(
                    s, v, old_v[j][rows.to(v.device)], target.to(v.dtype), weights[rows].to(v.device)
                )
                losses.backward(loss, len(rows) * share, step, [names[r] for r in rows.tolist()])
                for key, value in step_stats.items():
                    stats.setdefault(key, []).append(float(value))
        norm, applied = _update(
            run,
            params,
            f"step {step} (inner epoch {epoch})",
            losses,
            check_moved=not changed_checked,
            signal=lambda: bool(_gather((weights - 0.5).abs().max().reshape(1, 1).double(), state).max() > 0),
            unmoved=f"step {step}: the update changed no trainable parameter",
        )
        grad_norms.append(norm)
        changed_checked = changed_checked or applied
    module.eval()
    out = {key: _replica_mean(sum(v) / len(v), state) for key, v in stats.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def iteration(run: RLRun, step: int) -> tuple[dict[str, Any], RolloutResult]:
    """Iteration ``step`` (1-based): rollout, rewards, advantages, update; (its metrics, its rollout)."""
    with warnings.catch_warnings():  # FSDP2 warns that unpatchify's view is returned: no in-place op follows
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return _iteration(run, step)


def _iteration(run: RLRun, step: int) -> tuple[dict[str, Any], RolloutResult]:
    if getattr(run.algo, "OFFLINE", False):  # no rollout, no reward: the algorithm's own step (dpo)
        return run.algo.iteration(run, step)
    c, s, state, policy = run.config, run.config.algo, run.state, run.policy
    adapter = policy.adapter
    cpu = Clock()  # user CPU seconds of this process: the phases' cost whatever else the machine runs
    started, cpu_started = time.perf_counter(), cpu.now()
    chosen = [run.prompts[i] for i in next(run.sampler)]
    texts = [p.text for p in chosen]
    g = s.group_size
    batch = repeat_batch(adapter.encode(texts, c.data.negative_prompt), g)
    sample_prompts = [t for t in texts for _ in range(g)]
    names = [f"{p.where} (sample {k})" for p in chosen for k in range(g)]
    b = len(sample_prompts)
    if getattr(run.algo, "WINDOW_PER_ITERATION", False):  # a window that moves over training (MixGRPO)
        window_size, window_range = run.algo.window(s, c.sampling.num_inference_steps, step)
    else:
        window_size, window_range = run.algo.window(s, c.sampling.num_inference_steps)
    policy.module.eval()
    generators = sample_generators(c.model.seed, step, state.dp_rank * b, b)
    chunk = c.sampling.batch_size or b
    initial = None  # the starting noise when the algorithm shares it within a group (DanceGRPO)
    if hasattr(run.algo, "initial_noise"):
        initial = run.algo.initial_noise(s, c.model.seed, step, state.dp_rank * b, b, adapter.latent_shape)
    parts = [
        rollout(
            adapter,
            policy.module,
            select_rows(batch, range(first, min(first + chunk, b))),
            latent_shape=adapter.latent_shape,
            num_inference_steps=c.sampling.num_inference_steps,
            window_size=window_size,
            generators=generators[first : first + chunk],
            window_start_range=window_range,
            noise_level=s.noise_level,
            initial_latents=None if initial is None else initial[first : first + chunk],
        )
        for first in range(0, b, chunk)
    ]
    res = concat_rollouts(parts)
    rolled, cpu_rolled = time.perf_counter(), cpu.now()
    pixels = torch.cat([adapter.decode(res.final_latents[i : i + chunk]) for i in range(0, b, chunk)])
    every = score(run, pixels, sample_prompts)  # [1 + K, D * B]
    scored, cpu_scored = time.perf_counter(), cpu.now()
    group_ids = torch.arange(every.shape[1]) // g
    advantages_all = run.algo.advantages(s, every[0], group_ids)
    advantages = advantages_all[state.dp_rank * b : (state.dp_rank + 1) * b]
    lr = run.optimizer.param_groups[0]["lr"]
    if getattr(run.algo, "FORWARD_PROCESS", False):  # trains on the clean samples, not the steps (DiffusionNFT)
        trained = _train_forward(run, step, res, batch, advantages, names)
    else:
        trained = _train(run, step, res, batch, advantages, names)
    run.scheduler.step()
    metrics: dict[str, Any] = {"step": step, "reward": every[0].mean().item(), "reward_std": every[0].std().item()}
    for k, name in enumerate(run.reward_names, 1):
        metrics[f"reward/{name}"] = every[k].mean().item()
        metrics[f"reward_std/{name}"] = every[k].std().item()
    if hasattr(run.algo, "iteration_metrics"):  # the algorithm's own (e.g. MixGRPO's window position)
        metrics.update(run.algo.iteration_metrics(s, c.sampling.num_inference_steps, step))
    metrics.update(
        advantage_mean=advantages_all.mean().item(),
        advantage_std=advantages_all.std().item(),
        advantage_abs_max=advantages_all.abs().max().item(),
        **trained,
        lr=lr,
        logprob_gap_alarm=int(trained.get("logprob_gap_max", 0.0) > getattr(s, "logprob_gap_alarm", math.inf)),
        skipped_nonfinite=run.skipped_nonfinite,
        wall_time_rollout=rolled - started,
        wall_time_reward=scored - rolled,
        wall_time_train=time.perf_counter() - scored,
        cpu_time_rollout=cpu_rolled - cpu_started,
        cpu_time_reward=cpu_scored - cpu_rolled,
        cpu_time_train=cpu.now() - cpu_scored,
    )
    return metrics, res


def _alarm(run: RLRun, metrics: dict[str, Any]) -> None:
    s = run.config.algo
    if not metrics["logprob_gap_alarm"]:
        return
    message = (
        f"step {metrics['step']}: rollout vs training log-prob gap max |dlogp| = {metrics['logprob_gap_max']:.3g} "
        f"(mean {metrics['logprob_gap_mean']:.3g}) on the first inner step, above "
        f"{run.config.algorithm}.logprob_gap_alarm={s.logprob_gap_alarm:g}: rollout and training disagree "
        "(schedule, guidance, weights or inputs)"
    )
    if s.on_logprob_gap == "stop":
        raise LogProbGapError(message + f"; stopped ({run.config.algorithm}.on_logprob_gap: stop)")
    run.logger.say(f"ALARM {message}")


def start_run(config: RLConfig) -> tuple[RLRun, int, CheckedRLInputs]:
    """Checks, policy, rewards, optimizer, and the resumed state when there is a checkpoint to resume from:
    (the run, the step it resumes after, the checked inputs)."""
    from runtime.train.loop import resume, setup_parallel, train_device
    from runtime.train.optim import build_optimizer, build_scheduler

    state = setup_parallel(config)
    inputs = check_rl_inputs(config, state)  # before the model is built: a user error costs seconds
    check_mode(config.train.nonfinite, "train.nonfinite")
    rewards, error = None, None
    if config.rewards and (config.reward_ranks is None or state.rank in config.reward_ranks):  # where they run
        rewards, error = _attempt(build_rewards, config.rewards)
    agree(error, state)
    torch.manual_seed(config.model.seed)
    policy = build_policy(config, state, train_device(state))
    optimizer = build_optimizer(policy.trainable, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.train.steps)
    sampler = PromptSampler(
        len(inputs.prompts), config.data.prompts_per_step, config.data.seed, state.dp_rank, state.dp_size
    )
    start, skipped = 0, 0
    if inputs.resume_from is not None:
        saved = policy.checkpoint_module
        schedule = schedule_record(config)
        start, skipped = resume(inputs.resume_from, saved, optimizer, scheduler, sampler, policy.identity, schedule)
    logger = RLMetricsLogger(  # collective: a tracker that cannot start stops every rank
        config.log,
        config.train.steps,
        state.rank == 0,
        run_config=dataclasses.asdict(config),
        start_step=start,
        samples_per_step=sampler.per_iteration * config.algo.group_size,  # global samples per iteration
    )
    algo = algorithm_module(config.algorithm)
    names = reward_names(config.rewards)
    run = RLRun(config, state, policy, rewards, names, inputs.prompts, sampler, optimizer, scheduler, algo, logger)
    run.skipped_nonfinite = skipped
    if inputs.resume_from is not None:
        logger.say(f"resumed from {inputs.resume_from} at step {start}")
    logger.say(f"{config.algorithm}: {algo.conventions(config.algo)}")
    return run, start, inputs


def save(run: RLRun, step: int) -> Path:
    """A checkpoint of ``run`` after ``step`` (collective): the trained weights (the LoRA adapter alone for LoRA
    runs, + EMA), AdamW, the LR schedule, the RNG states and the prompt position."""
    from runtime.checkpoint.dcp import save_checkpoint

    ckpt = run.config.checkpoint
    return save_checkpoint(
        Path(ckpt.dir),
        step,
        run.policy.checkpoint_module,
        run.optimizer,
        run.scheduler,
        {
            "step": step,
            "data": run.sampler.state_dict(),
            "skipped_nonfinite": run.skipped_nonfinite,
            "schedule": schedule_record(run.config),
        },
        identity=run.policy.identity,
        keep=ckpt.save_total_limit,
    )


def run_rl(config: RLConfig) -> RLResult:
    """Run ``config``: checks, policy, rewards, resume, the iterations, checkpoints, export."""
    run, start, inputs = start_run(config)
    history: list[dict[str, Any]] = []
    res = None
    ckpt = config.checkpoint
    try:
        for step in range(start + 1, config.train.steps + 1):
            metrics, res = iteration(run, step)
            history.append(metrics)
            run.logger.log(metrics, echo=step % config.log.interval == 0 or step == config.train.steps)
            _alarm(run, metrics)
            if ckpt.interval and step % ckpt.interval == 0:
                save(run, step)
        if history:
            run.logger.finish(history[-1]["step"], run.reward_names)  # the reward/loss PNG: run dir and trackers
    finally:
        run.logger.close()
    if config.export.dir:
        run.policy.export()
    return RLResult(history, start, list(inputs.skipped_checkpoints), policy=run.policy, last_rollout=res)
