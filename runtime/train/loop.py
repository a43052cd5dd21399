"""The trainer: FSDP2 + Ulysses SP, exact resume, metrics, checkpoints and export, shared by every model family.

``run_job`` is the loop (optimizer, schedule, resume, metrics, checkpoints, export); a family supplies a ``Job``:
text and vision-language models here (packed rows, global token-weighted loss), DiTs in ``runtime/train/dit.py``
(frozen condition model, flow matching).

Text loss convention: ``runtime/train/text_step.py``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoint.dcp import load_checkpoint, save_checkpoint
from runtime.checkpoint.export import export_hf
from runtime.checkpoint.identity import model_identity, unproven_identity
from runtime.checkpoint.lora_weights import adapter_modules
from runtime.checkpoint.rank_state import rank_files
from runtime.checkpoint.verify import CheckpointError, read_marker
from runtime.config.errors import ConfigError
from runtime.models.registry import lookup
from runtime.moe.dispatch import check_ep_kernel
from runtime.parallel.expert_parallel import check_ep
from runtime.parallel.fsdp import clip_grad_norm_
from runtime.parallel.parallelize import parallelize
from runtime.parallel.state import ParallelState, init_parallel_state
from runtime.train.config import RunConfig
from runtime.train.data import (
    build_loader,
    check_sp,
    check_vocab,
    fixed_model_config,
    is_dit,
    load_text_processor,
)
from runtime.train.evaluate import TextEvaluator, build_eval_loader, eval_due, read_eval_samples
from runtime.train.finite import check_mode, guard_update, micro_batches
from runtime.train.job import Job, parallel_plan, train_device
from runtime.train.job import StepWork as StepWork  # re-exported: a Job's step work, beside Job
from runtime.train.lora import add_text_lora, lora_identity
from runtime.train.metrics import (
    MetricsLogger,
    StepMetrics,
    detect_peak_tflops,
    flops_per_token,
    tflops_per_device,
)
from runtime.train.model import build_model
from runtime.train.optim import build_optimizer, build_scheduler
from runtime.train.packed_documents import check_packed_documents
from runtime.train.preflight import CheckedInputs, check_inputs
from runtime.train.schedule_keys import follow_schedule, followed_schedule, schedule_record
from runtime.train.self_check_job import self_check
from runtime.train.summary import model_summary, run_summary, say
from runtime.train.text_step import sample_names, text_forward_backward


@dataclass(frozen=True)
class RunResult:
    metrics: list[StepMetrics]
    start_step: int  # 0 for a fresh run, k when resumed from the step-k checkpoint
    skipped_checkpoints: list[str] = field(default_factory=list)  # damaged ones `resume: auto` passed over
    model: Any = field(default=None, repr=False, compare=False)  # the trained module as the run left it


def setup_parallel(config: RunConfig) -> ParallelState:
    p = config.parallel
    try:
        return init_parallel_state(
            sp_size=p.sp,
            dp_replicate_size=p.dp_replicate,
            dp_shard_size=p.dp_shard,
            ep_size=p.ep,
            ring_size=p.ring,
            overlap=p.overlap,
        )
    except ValueError as exc:
        raise ConfigError(f"parallel: {exc}") from None


def train(config: RunConfig) -> RunResult:
    state = setup_parallel(config)
    say(state, run_summary(config, state))  # the first thing printed: what runs where
    say(state, "checking the inputs (data, outputs, the checkpoint to resume) ...")
    inputs = check_inputs(config, state)  # before the model is built: a user error costs seconds, not a model build
    torch.manual_seed(config.model.seed)
    say(state, "building the model and its data ...")
    if is_dit(config):
        from runtime.train.dit import build_dit_job

        job = build_dit_job(config, state, inputs)
    else:
        job = build_text_job(config, state, inputs)
    say(state, model_summary(job.model, len(inputs.dit_samples if is_dit(config) else inputs.samples)))
    self_check(config, state, job.model)  # a shrunk copy of the model, this layout vs one process; stops on a mismatch
    return run_job(job, config, state, inputs.resume_from, inputs.skipped_checkpoints)


def build_text_job(config: RunConfig, state: ParallelState, inputs: CheckedInputs) -> Job:
    """Text and vision-language models: tokenizer/processor, the generated model, packed rows, EP/FSDP."""
    eval_samples = read_eval_samples(config)  # the held-out file checked before the model is built
    processor = load_text_processor(config)  # a tokenizer, or a VLM's processor
    model = build_model(config.model, fixed_model_config(config, processor))
    mc = model.config
    check_sp(model, config, state.sp_size)
    check_packed_documents(lookup(config.model.type), model.config)  # a mixer carrying state across packed rows
    check_vocab(model, processor)
    loader = build_loader(config, state, model, processor, inputs.samples)
    names = sample_names(inputs.samples) if loader.num_dropped == 0 else None  # loader.samples[i] is samples[i]
    device = train_device(state)
    if state.ep_enabled:
        try:
            check_ep_kernel(model)
            check_ep(model, state)
        except ValueError as exc:
            raise ConfigError(f"parallel.ep: {exc}") from None
    peft_configs = []  # LoRA (runtime/train/lora.py): parallelize injects it between EP and FSDP2

    def add_lora(module: torch.nn.Module) -> None:
        peft_configs.append(add_text_lora(module, config, state))

    adapters = add_lora if config.lora.rank is not None else None
    model = parallelize(model, state, parallel_plan(config), device, adapters=adapters)
    lora = peft_configs[0] if peft_configs else None

    def export() -> None:
        tokenizer, out = config.data.processor or processor, Path(config.export.dir)
        unproven = config.train.self_check.unproven
        if lora is None:
            export_hf(model, mc, out, tokenizer=tokenizer, overwrite=config.export.overwrite, unproven=unproven)
            what = "a plain-transformers checkpoint"
        else:  # the adapter peft loads, or (fuse_lora) the merged plain checkpoint
            from runtime.checkpoint.lora_export import export_lora

            base_class, fuse = lookup(config.model.type).upstream_class(), config.export.fuse_lora
            export_lora(
                model, mc, out, lora, base_class, fuse=fuse, tokenizer=tokenizer, base_path=config.model.path,
                overwrite=config.export.overwrite, unproven=unproven,
            )  # fmt: skip
            what = "a plain-transformers checkpoint (LoRA merged)" if fuse else "a peft LoRA adapter"
        if state.rank == 0:
            print(f"exported {what} to {config.export.dir}", flush=True)

    evaluate = None
    if eval_samples is not None:
        eval_loader = build_eval_loader(config, model, processor, eval_samples)
        evaluate = TextEvaluator(model, eval_loader, state, config, device)
    return Job(
        model=model,
        loader=loader,
        forward_backward=lambda step: text_forward_backward(model, loader, state, config, names),
        evaluate=evaluate,
        flops_per_token=flops_per_token(mc.get_text_config(), config.data.token_budget),  # the LM's (a ViT's not)
        export=export,
        # LoRA: checkpoints hold the adapter (and its optimizer state) only; the base comes from model.path or the seed
        checkpoint_model=None if lora is None else adapter_modules(model),
        identity=None if lora is None else lora_identity(config.model.type, mc, lora),
    )


def run_job(
    job: Job,
    config: RunConfig,
    state: ParallelState,
    resume_from: Path | None = None,
    skipped_checkpoints: list[str] | None = None,
) -> RunResult:
    """The loop every family shares: optimizer and schedule (``runtime/train/optim.py``), resume, metrics, eval,
    checkpoints, export; a step whose loss, gradient norm or learning rate is not finite stops the run or is skipped
    (``runtime/train/finite.py``)."""
    job.model.train()
    o = config.optim
    check_mode(config.train.nonfinite, "train.nonfinite")
    trained = [p for p in job.model.parameters() if p.requires_grad]  # frozen parts (a ViT, LoRA's base) left out
    optimizer = build_optimizer(trained, o)
    scheduler = build_scheduler(optimizer, o, config.train.steps)
    saved = job.checkpoint_model if job.checkpoint_model is not None else job.model
    identity = unproven_identity(job.identity or model_identity(config.model.type, job.model.config), config.train)

    start_step, skipped, note = 0, 0, None
    ckpt = config.checkpoint
    schedule = schedule_record(config)  # what the run follows and its checkpoints record
    if resume_from is not None:
        start_step, skipped, schedule, note = resume(
            resume_from, saved, optimizer, scheduler, job.loader, identity, schedule, ckpt.schedule_change
        )

    logger = MetricsLogger(  # collective: a tracker that cannot start stops every rank
        config.log,
        config.train.steps,
        enabled=state.rank == 0,
        run_config=dataclasses.asdict(config),
        start_step=start_step,
        samples_per_step=job.samples_per_step,
    )
    if resume_from is not None:
        logger.say(f"resumed from {resume_from} at step {start_step}")
    if note is not None:
        logger.say(note)
    peak = config.log.peak_tflops or detect_peak_tflops()
    metrics: list[StepMetrics] = []
    try:
        for step in range(start_step + 1, config.train.steps + 1):
            metrics.append(train_step(step, job, optimizer, scheduler, state, config, peak, skipped))
            if job.evaluate is not None and eval_due(config, step):
                metrics[-1] = dataclasses.replace(metrics[-1], eval_loss=job.evaluate())
            skipped = metrics[-1].skipped_nonfinite
            logger.log(metrics[-1], echo=step % config.log.interval == 0 or step == config.train.steps)
            if job.after_step is not None:
                job.after_step(step, logger)
            if ckpt.interval and step % ckpt.interval == 0:
                save_checkpoint(
                    Path(ckpt.dir),
                    step,
                    saved,
                    optimizer,
                    scheduler,
                    {
                        "step": step,
                        "data": job.loader.state_dict(),
                        "skipped_nonfinite": skipped,
                        "schedule": schedule,
                    },
                    identity=identity,
                    keep=ckpt.save_total_limit,
                )
        if metrics:
            logger.finish(metrics[-1].step)  # the loss curve PNG, to the run directory and the trackers
    finally:
        logger.close()
    if config.export.dir and job.export is not None:
        job.export()
    return RunResult(metrics, start_step, list(skipped_checkpoints or []), model=job.model)


def resume(
    path: Path,
    model,
    optimizer,
    scheduler,
    loader,
    identity: dict[str, Any],
    schedule: dict[str, Any],
    schedule_change: str = "refuse",
) -> tuple[int, int, dict[str, Any], str | None]:
    """Load the (already verified) checkpoint ``path`` into the run, refused before any weight is read when it was
    saved from another model than ``identity``: (its step, the non-finite steps skipped up to it, the schedule keys
    the resumed steps follow, a log line when they are not this run's plain plan). A learning-rate ``schedule`` that
    differs from the saved one follows ``schedule_change`` (``runtime/train/schedule_keys.py``). Mismatches and state
    this trainer did not write are user errors."""
    try:
        extra = load_checkpoint(path, model, optimizer, scheduler, identity=identity, verify=False)
    except CheckpointError as exc:  # names the checkpoint
        raise ConfigError(f"checkpoint.resume: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"checkpoint.resume: {path}: {exc}") from None
    step, skipped, data = extra.get("step"), extra.get("skipped_nonfinite", 0), extra.get("data")
    for key, value in (("step", step), ("skipped_nonfinite", skipped)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"checkpoint.resume: {path}: its extra.{key} is {value!r}, expected a whole number >= 0")
    if not isinstance(data, dict):
        raise ConfigError(f"checkpoint.resume: {path}: its extra.data (the data position) is {data!r}")
    source = _state_file(Path(path))
    followed, note = followed_schedule(extra.get("schedule"), schedule, path, step, schedule_change, source)
    follow_schedule(scheduler, optimizer, followed, schedule["train.steps"])
    try:
        loader.load_state_dict(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(
            f"checkpoint.resume: {path}: its data position does not fit this run's data: {exc}"
        ) from None
    return step, skipped, followed, note


def _state_file(path: Path) -> Path:
    """The per-rank state file ``load_checkpoint`` read on this rank (its own; rank 0's when the world size changed),
    named when what it recorded is refused."""
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank_files(path, rank if read_marker(path)["world_size"] == world else 0)[1]


def train_step(
    step: int,
    job: Job,
    optimizer,
    scheduler,
    state: ParallelState,
    config: RunConfig,
    peak_tflops: float | None,
    skipped: int = 0,
) -> StepMetrics:
    """One optimizer step: the family's forward/backward passes, clipping, the non-finite guard, AdamW, schedule,
    (EMA), metrics. A skipped step (``train.nonfinite: skip``) changes no parameter, no optimizer state and no EMA;
    the schedule and the data still advance, so the run ends at the step it would have ended."""
    started = time.perf_counter()
    work = job.forward_backward(step)
    grad_norm = clip_grad_norm_(job.model.parameters(), config.optim.max_grad_norm or float("inf"))
    lr = scheduler.get_last_lr()[0]
    applied = guard_update(
        step,
        work.loss,
        grad_norm,
        optimizer,
        mode=config.train.nonfinite,
        sources=lambda: micro_batches(work.micro_losses, work.describe()),
    )
    if applied:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if applied and job.after_optimizer_step is not None:
        job.after_optimizer_step()
    elapsed = time.perf_counter() - started
    flops = job.flops_per_token * work.processed if work.flops is None else work.flops
    tflops = tflops_per_device(flops, elapsed, state.world_size)
    return StepMetrics(
        step=step,
        loss=work.loss.item(),
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(work.count),
        tokens_per_s=work.processed / elapsed,
        tflops_per_device=tflops,
        mfu=None if peak_tflops is None else tflops / peak_tflops,
        skipped_nonfinite=skipped + (not applied),
    )
