"""The state an RL run carries from one iteration to the next (``RLRun``), and its life outside the iterations:
built from a checked config, or resumed from a checkpoint (``start_run``), and checkpointed (``save``). The loop
(``loop.py``) only reads and advances it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.config.errors import ConfigError
from runtime.parallel.state import ParallelState
from runtime.rl.algorithms.base import Algorithm
from runtime.rl.config import RLConfig, algorithm
from runtime.rl.metrics import RLMetricsLogger
from runtime.rl.policy import Policy, build_policy
from runtime.rl.preflight import CheckedRLInputs, check_rl_inputs
from runtime.rl.prompts import Prompt, PromptSampler
from runtime.rl.replicas import agree
from runtime.rl.rewards import RewardMix, build_rewards, reward_names
from runtime.train.finite import check_mode
from runtime.train.schedule_keys import schedule_record
from runtime.train.summary import plan_summary, say

__all__ = ["RLRun", "earlier_history", "save", "start_run"]


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
    algo: Algorithm  # the algorithm, called through its contract only
    logger: RLMetricsLogger
    schedule: dict[str, Any]  # the schedule keys the run follows (runtime/train/schedule_keys.py), as saved
    skipped_nonfinite: int = 0
    # preference pairs' media latents by (path, height, width, frames), encoded once (runtime/rl/offline.py)
    latent_cache: dict[tuple[str, int, int, int | None], torch.Tensor] = field(default_factory=dict)


def _attempt(fn: Any, *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, message)`` for a user error (a config or reward error)."""
    try:
        return fn(*args), None
    except ConfigError as exc:
        return None, str(exc)


def start_run(config: RLConfig) -> tuple[RLRun, int, CheckedRLInputs]:
    """Checks, policy, rewards, optimizer, and the resumed state when there is a checkpoint to resume from:
    (the run, the step it resumes after, the checked inputs)."""
    from runtime.train.loop import resume, setup_parallel, train_device
    from runtime.train.optim import build_optimizer, build_scheduler
    from runtime.train.self_check_job import self_check_policy

    state = setup_parallel(config)
    model = config.model.type or config.model.architecture
    data = config.data.prompts or config.data.pairs
    head = f"run: {config.algorithm} on {model} from {config.model.path}, data {data}"
    say(state, f"{head} | {plan_summary(config, state)}")  # the first thing printed: what runs where
    say(state, "checking the inputs, building the rewards and the policy ...")
    inputs = check_rl_inputs(config, state)  # before the model is built: a user error costs seconds
    check_mode(config.train.nonfinite, "train.nonfinite")
    rewards, error = None, None
    if config.rewards and (config.reward_ranks is None or state.rank in config.reward_ranks):  # where they run
        rewards, error = _attempt(build_rewards, config.rewards)
        if rewards is not None:
            error = rewards.unreachable()  # at start-up, not at the first iteration's scoring
    agree(error, state)
    torch.manual_seed(config.model.seed)
    policy = build_policy(config, state, train_device(state))
    self_check_policy(config, state, policy.module)  # this layout proven on a shrunk copy; stops on a mismatch
    optimizer = build_optimizer(policy.trainable, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.train.steps)
    sampler = PromptSampler(
        len(inputs.prompts), config.data.prompts_per_step, config.data.seed, state.dp_rank, state.dp_size
    )
    start, skipped, note = 0, 0, None
    schedule = schedule_record(config)  # what the run follows and its checkpoints record
    if inputs.resume_from is not None:
        saved = policy.checkpoint_module
        start, skipped, schedule, note = resume(
            inputs.resume_from, saved, optimizer, scheduler, sampler, policy.identity, schedule,
            config.checkpoint.schedule_change,
        )  # fmt: skip
    logger = RLMetricsLogger(  # collective: a tracker that cannot start stops every rank
        config.log,
        config.train.steps,
        state.rank == 0,
        run_config=dataclasses.asdict(config),
        start_step=start,
        samples_per_step=sampler.per_iteration * config.algo.group_size,  # global samples per iteration
    )
    algo = algorithm(config.algorithm)
    names = reward_names(config.rewards)
    run = RLRun(
        config, state, policy, rewards, names, inputs.prompts, sampler, optimizer, scheduler, algo, logger, schedule
    )
    run.skipped_nonfinite = skipped
    if inputs.resume_from is not None:
        extra = _saved_extra(Path(inputs.resume_from), state.rank)
        algo.load_state_dict(extra.get("algorithm", {}))
        logger.say(f"resumed from {inputs.resume_from} at step {start}")
        history = earlier_history(extra.get("log_dir"), config.log.dir, start)
        if history is not None:
            logger.say(history)
    if note is not None:
        logger.say(note)
    logger.say(f"{config.algorithm}: {algo.conventions(config.algo)}")
    return run, start, inputs


def _saved_extra(path: Path, rank: int) -> dict[str, Any]:
    """What the run saved with checkpoint ``path`` beside the tensors (this rank's extra; rank 0's when the
    checkpoint was written by fewer ranks): the algorithm's state ({} before the contract saved it), the log
    directory (absent before it was recorded)."""
    import json

    for name in (f"rank_{rank:05d}.json", "rank_00000.json"):
        if (path / name).is_file():
            return json.loads((path / name).read_text()).get("extra", {})
    return {}


def _saved_algorithm_state(path: Path, rank: int) -> dict[str, Any]:
    """The algorithm's state saved with checkpoint ``path``; {} when it has none."""
    return _saved_extra(path, rank).get("algorithm", {})


def earlier_history(recorded: Any, log_dir: str, step: int) -> str | None:
    """The line a resumed run says when the steps before it were logged elsewhere: a run's metrics.jsonl and plot
    hold only what it logged, so a resume into a new ``log.dir`` starts its curves at ``step + 1``. None when the
    checkpoint's run logged here too (its lineage continues in this metrics.jsonl) or recorded no directory."""
    if not isinstance(recorded, str) or not recorded or Path(recorded) == Path(log_dir).resolve():
        return None
    return (
        f"steps 1-{step} were logged in {recorded} (recorded in the checkpoint): this run's metrics.jsonl and "
        f"plot in {log_dir} start at step {step + 1}"
    )


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
            "schedule": run.schedule,
            "algorithm": run.algo.state_dict(),  # the contract's checkpoint state (JSON; {} for the built-ins)
            "log_dir": str(Path(run.config.log.dir).resolve()),  # where these steps' metrics are (said at resume)
        },
        identity=run.policy.identity,
        keep=ckpt.save_total_limit,
    )
