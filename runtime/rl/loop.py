"""The RL loop shared by the algorithms: per iteration, this replica's prompts, a rollout of ``group_size`` samples
each under the current policy (no grad), their rewards over every rank (``scoring.py``; with ``async_reward`` each
rollout chunk is scored while the next rolls out: ``async_reward.py``), the algorithm's advantages
over the global batch, and its objective recomputed with grad over the rollout's window steps, AdamW included
(``update.py``); then the guards, metrics, checkpoints. The state the iterations advance, its setup, resume and
checkpoints: ``run_state.py``.

Seeds. Sample ``i`` of replica ``r`` at iteration ``k`` is global sample ``q = r * B + i`` and gets its own
``torch.Generator`` seeded from ``(model.seed, k, q)`` alone: it draws the sample's window start, its initial noise
and its SDE noise (``runtime/rl/sampling/rollout.py``). So the SP ranks of a replica roll out identical samples (same
prompts: ``PromptSampler`` reads only the replica), ``D`` replicas roll out, sample for sample, what one process with
``D`` times the prompts rolls out, and a run resumed at iteration ``k`` draws exactly what the uninterrupted run drew
(the per-sample seeds are a function of the step and the data position, both checkpointed).

Guards (each one line, exit 2 through ``python -m runtime.rl``):

* non-finite loss, gradient norm or learning rate: ``runtime/train/finite.py`` (``train.nonfinite``: stop | skip);
* the rollout-vs-training log-prob gap: on the first inner step the policy has not moved, so recomputed log-probs
  must equal the rollout's (bitwise in the rollout's batch layout). ``max |dlogp|`` above ``logprob_gap_alarm``
  prints an alarm (``on_logprob_gap: warn``) or stops the run (``stop``): a gap means rollout and training disagree
  on the schedule, the guidance, the weights (a LoRA bound to modules the forward does not run) or the inputs;
* the policy cannot or did not change (``PolicyUnchangedError``): ``update.py``.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.config.errors import ConfigError
from runtime.kernels.timing import Clock
from runtime.rl.algorithms.objectives import zero_std_ratio
from runtime.rl.async_reward import ChunkScorer
from runtime.rl.batch import repeat_batch, select_rows
from runtime.rl.config import RLConfig
from runtime.rl.experts import fit_window
from runtime.rl.offline import offline_iteration
from runtime.rl.run_state import RLRun, save, start_run
from runtime.rl.sampling.rollout import RolloutResult, rollout
from runtime.rl.update import train_forward, train_steps

__all__ = ["LogProbGapError", "RLResult", "concat_rollouts", "iteration", "run_rl", "sample_generators"]


class LogProbGapError(ConfigError):
    """The rollout's and the training side's log-probs disagree on the first inner step (``on_logprob_gap: stop``)."""


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


def iteration(run: RLRun, step: int) -> tuple[dict[str, Any], RolloutResult | None]:
    """Iteration ``step`` (1-based): rollout, rewards, advantages, update; (its metrics, its rollout)."""
    with warnings.catch_warnings():  # FSDP2 warns that unpatchify's view is returned: no in-place op follows
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return _iteration(run, step)


def _iteration(run: RLRun, step: int) -> tuple[dict[str, Any], RolloutResult | None]:
    algo = run.algo  # called through its contract only (runtime/rl/algorithms/base.py)
    if algo.data == "pairs":  # offline preference pairs: no rollout, no reward (dpo)
        return offline_iteration(run, step), None
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
    window_size, window_range = algo.window(s, c.sampling.num_inference_steps, step)  # MixGRPO's moves with step
    # two experts (Wan2.2 A14B): only the windows that lie in the trained expert's steps
    window_range = fit_window(c, policy.trained_steps, step, window_size, window_range)
    policy.module.eval()
    generators = sample_generators(c.model.seed, step, state.dp_rank * b, b)
    chunk = c.sampling.batch_size or b
    # the starting noise when the algorithm shares it within a group (DanceGRPO), else None: each sample its own
    initial = algo.initial_noise(s, c.model.seed, step, state.dp_rank * b, b, adapter.latent_shape)
    # each chunk's rewards: scored at the end, or (async_reward) in the background while the next chunk rolls out
    scorer = ChunkScorer(run, adapter.decode, b)
    parts = []
    for first in range(0, b, chunk):
        parts.append(
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
        )
        scorer.add(parts[-1].final_latents, sample_prompts[first : first + chunk])
    res = concat_rollouts(parts)
    rolled, cpu_rolled = time.perf_counter(), cpu.now()
    every = scorer.result()  # [1 + K, D * B]
    scored, cpu_scored = time.perf_counter(), cpu.now()
    group_ids = torch.arange(every.shape[1]) // g
    advantages_all = algo.advantages(s, every[0], group_ids)
    advantages = advantages_all[state.dp_rank * b : (state.dp_rank + 1) * b]
    lr = run.optimizer.param_groups[0]["lr"]
    if algo.trains_on == "clean_samples":  # the forward process on the final samples, not the steps (DiffusionNFT)
        trained = train_forward(run, step, res, batch, advantages, names)
    else:
        trained = train_steps(run, step, res, batch, advantages, names)
    run.scheduler.step()
    metrics: dict[str, Any] = {"step": step, "reward": every[0].mean().item(), "reward_std": every[0].std().item()}
    for k, name in enumerate(run.reward_names, 1):
        metrics[f"reward/{name}"] = every[k].mean().item()
        metrics[f"reward_std/{name}"] = every[k].std().item()
    metrics.update(algo.iteration_metrics(s, c.sampling.num_inference_steps, step))  # e.g. MixGRPO's window
    iteration_time = time.perf_counter() - started
    metrics.update(
        zero_std_ratio=zero_std_ratio(every[0], group_ids),
        samples_per_second_per_gpu=every.shape[1] / iteration_time / state.world_size,
        advantage_mean=advantages_all.mean().item(),
        advantage_std=advantages_all.std().item(),
        advantage_abs_max=advantages_all.abs().max().item(),
        **trained,
        lr=lr,
        logprob_gap_alarm=int(trained.get("logprob_gap_max", 0.0) > algo.gap_alarm(s)),
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
            offline = run.algo.data == "pairs"
            run.logger.finish(history[-1]["step"], run.reward_names, offline)  # the PNG: run dir and trackers
    finally:
        run.logger.close()
    if config.export.dir:
        run.policy.export()
    return RLResult(history, start, list(inputs.skipped_checkpoints), policy=run.policy, last_rollout=res)
