"""The DiT family of the trainer: what ``run_job`` (``runtime/train/loop.py``) needs to train Wan, Flux or
Qwen-Image with a frozen condition model.

Setup order (every user error surfaces before the transformer is loaded): data file and buckets (media probed over
the ranks), condition-model options, the condition cache (missing entries computed, then the condition model is
dropped) or the on-the-fly condition model, then the transformer from the pipeline's ``transformer/`` (LoRA through
peft or full fine-tuning), FSDP2 (+ HSDP) with activation checkpointing, EMA.

The condition model is frozen and replicated (never sharded, never in the optimizer); with cached conditions only
its scheduler settings are loaded (``encoders=False``).
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.checkpoint.identity import model_identity
from runtime.config.errors import ConfigError
from runtime.diffusion.cache import CacheError
from runtime.parallel.fsdp import block_modules
from runtime.parallel.parallelize import parallelize
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig
from runtime.train.dit_data import (
    CachedConditions,
    LiveConditions,
    build_dataset,
    fill_cache,
    media_rules,
    read_dit_samples,
    sample_keys,
)
from runtime.train.dit_step import latent_tokens, noise_generators, weighted_flow_matching_loss
from runtime.train.job import Job, StepWork, all_reduce_sum, parallel_plan, to_device, train_device
from runtime.train.samples import ValidationSampler

__all__ = ["build_dit_job", "check_pipeline_dir", "load_condition_model_for", "setup_conditions"]


def check_pipeline_dir(config: RunConfig) -> None:
    """``model.path`` must be a diffusers pipeline directory with a transformer."""
    path = Path(config.model.path)
    if not (path / "model_index.json").is_file():
        what = "no model_index.json in it" if path.is_dir() else "not a directory"
        raise ConfigError(
            f"model.path: {path}: {what} (expected a diffusers pipeline directory: model_index.json, transformer/, "
            f"VAE, text encoders, scheduler)"
        )
    if not (path / "transformer" / "config.json").is_file():
        raise ConfigError(f"model.path: {path}: no transformer/config.json (the transformer training starts from)")


def load_condition_model_for(config: RunConfig, encoders: bool, device: torch.device | None = None) -> Any:
    """The frozen condition model of ``model.type`` from ``model.path`` with ``dit.condition`` options."""
    from runtime.diffusion.conditions import load_condition_model
    from runtime.diffusion.registry import lookup_dit

    condition_type = lookup_dit(config.model.type).data["condition_model_type"]
    try:
        model = load_condition_model(condition_type, config.model.path, encoders=encoders, **config.dit.condition)
    except (TypeError, ValueError) as exc:  # an unknown option, or a bad value of one
        message = " ".join(str(exc).split())[:300]
        raise ConfigError(f"dit.condition: {config.dit.condition!r}: {message}") from None
    return model if device is None else model.to(device)


def setup_conditions(config: RunConfig, state: ParallelState, dataset: Any, device: torch.device) -> tuple[Any, Any]:
    """(condition model for ``process_condition``, the per-step source of conditions). With ``data.cache``: fill
    the cache first, then read from it with a condition model loaded without its encoders."""
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import lookup_dit

    light = load_condition_model_for(config, encoders=False)  # checks the options in a second, encoders or not
    if not config.data.cache:
        if state.rank == 0:
            print("conditions: computed at every step by the condition model (data.cache: null)", flush=True)
        live = load_condition_model_for(config, encoders=True, device=device)
        return live, LiveConditions(live, dataset)
    from runtime.diffusion.cache import ConditionCache, FileDigests, condition_fingerprint

    condition_type = lookup_dit(config.model.type).data["condition_model_type"]
    cache = ConditionCache(config.data.cache)
    digests = FileDigests(cache.directory / "file_digests.json")
    fingerprint = [None]
    if state.rank == 0:  # the encoders' weights are hashed once (memoised by size + mtime), not on every rank
        cls = condition_model_class(condition_type)
        fingerprint = [condition_fingerprint(config.model.path, condition_type, cls, digests)]
    if dist.is_initialized():
        dist.broadcast_object_list(fingerprint, src=0)
    keys, memo = sample_keys(dataset, fingerprint[0], digests, state)
    if state.rank == 0:
        digests.update(memo)
        digests.save()
    cache.labels = {key: dataset.samples[index].where for index, key in enumerate(keys)}
    # conditions that are not finite are refused while filling (NonFiniteConditionError, a MediaError: raised on
    # every rank as a ConfigError naming the sample's file:line)
    fill_cache(cache, keys, dataset, lambda: load_condition_model_for(config, encoders=True, device=device), state)
    try:
        cache.verify(keys)  # every shard the run reads, hashed once over the ranks before any tensor is read
    except CacheError as exc:
        raise ConfigError(f"data.cache: {exc}") from None
    if state.rank == 0:
        shards = len({cache.shard_of(key) for key in keys})
        print(
            f"conditions: reading {len(keys)} samples from {shards} shard(s) of the cache {cache.directory}",
            flush=True,
        )
    return light.to(device), CachedConditions(cache, keys)


def transformer_folder(config: RunConfig) -> str:
    """The pipeline's transformer this job trains: ``transformer``, or of a pipeline with two experts switched at
    ``boundary_ratio`` (Wan2.2 A14B) the one ``dit.condition.expert`` names (its noise levels only)."""
    index = json.loads((Path(config.model.path) / "model_index.json").read_text())
    expert = config.dit.condition.get("expert")
    if index.get("transformer_2", [None])[0] is not None and expert is None:
        raise ConfigError(
            f"dit.condition.expert: {config.model.path} holds two transformers switched at boundary_ratio "
            f"{index.get('boundary_ratio')} (Wan2.2 A14B): set 'transformer' (high noise) or 'transformer_2' (low "
            f"noise); training both in one job is not supported (they share no parameters: run one job per expert)"
        )
    return expert or "transformer"


def load_transformer(config: RunConfig) -> torch.nn.Module:
    from runtime.diffusion.registry import training_class

    cls = training_class(config.model.type)
    backend = (
        {} if config.model.attn_implementation == "sdpa" else {"attention_backend": config.model.attn_implementation}
    )
    try:
        model, info = cls.from_pretrained(
            config.model.path, subfolder=transformer_folder(config), output_loading_info=True, **backend
        )
    except (OSError, ValueError) as exc:
        message = " ".join(str(exc).split())[:300]
        raise ConfigError(
            f"model.path: cannot load {config.model.path}/transformer as {cls.__name__}: {message}"
        ) from None
    # the shell loads what diffusers loads (unexpected weights are reported, not refused); the trainer refuses them
    if info["unexpected_keys"]:
        keys = info["unexpected_keys"]
        raise ConfigError(
            f"model.path: {config.model.path}/transformer has {len(keys)} weight(s) {cls.__name__} does not have: "
            f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}; use a checkpoint of this model type and size"
        )
    return model


def dit_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """6 x (matmul parameters) + attention scores (non-causal, fwd+bwd) per transformer token."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv3d))
    c = model.config
    head_dim = getattr(c, "attention_head_dim", None) or c.hidden_size // c.num_attention_heads  # Lumina2: no field
    inner = c.num_attention_heads * head_dim
    return 6.0 * matmul + 12.0 * len(block_modules(model)) * seq_len * inner


def build_dit_job(config: RunConfig, state: ParallelState, inputs: Any) -> Job:
    from runtime.data.dit.sampler import BucketBatchSampler
    from runtime.data.sampler import Order
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import lookup_dit

    quiet_loading()
    check_pipeline_dir(config)
    check_transformer(config, state.ulysses_size)
    entry = lookup_dit(config.model.type)
    rules = media_rules(condition_model_class(entry.data["condition_model_type"]))
    samples = getattr(inputs, "dit_samples", None) or read_dit_samples(config)
    dataset = build_dataset(config, samples, rules, state)
    device = train_device(state)
    try:
        order = Order.for_parallel_state(state, config.data.seed)
        sampler = BucketBatchSampler(dataset.buckets, config.data.batch_size, order)
    except ValueError as exc:  # too few samples per bucket for batch_size x data-parallel replicas
        raise ConfigError(f"data.path: {config.data.path}: {exc}") from None
    if state.rank == 0:
        warn_small_buckets(dataset.buckets, config.data.batch_size, rules.video)
    condition_model, conditions = setup_conditions(config, state, dataset, device)

    model = load_transformer(config)
    peft_config = None
    if config.lora.rank is not None:
        from runtime.train.lora import add_lora

        torch.manual_seed(config.model.seed)  # the adapter's initial A: identical on every rank
        peft_config = add_lora(model, config.lora)
    model = parallelize(model, state, parallel_plan(config), device)  # LoRA first: a DiT has no expert parallelism
    ema = None
    if config.dit.ema_decay is not None:
        from runtime.train.ema import EMA

        ema = EMA(model, config.dit.ema_decay).to(device)

    seq = max(_latent_tokens_of_bucket(b, rules) for b in set(dataset.buckets))
    return Job(
        model=model,
        loader=sampler,
        forward_backward=functools.partial(
            dit_forward_backward,
            model=model,
            sampler=sampler,
            conditions=conditions,
            condition_model=condition_model,
            state=state,
            config=config,
            device=device,
        ),
        flops_per_token=dit_flops_per_token(model, seq),
        export=functools.partial(export, config=config, state=state, model=model, ema=ema, peft_config=peft_config),
        checkpoint_model=checkpointed(model, ema, lora=peft_config is not None),
        after_optimizer_step=None if ema is None else ema.update,
        identity=dit_identity(config, model),
        after_step=ValidationSampler(config, state.rank, device, model, ema, peft_config, rules.video),
        samples_per_step=config.data.batch_size * config.train.micro_batches * state.dp_size,
    )


def dit_identity(config: RunConfig, model: torch.nn.Module) -> dict[str, Any]:
    """What a DiT checkpoint must match on resume: the transformer's config and the LoRA settings (a LoRA
    checkpoint holds only the adapter, whose meaning depends on its rank, alpha and targets), and which of two
    experts it trains (Wan2.2 A14B's have the same config)."""
    lora = config.lora
    adapter = None if lora.rank is None else {"rank": lora.rank, "alpha": lora.alpha, "targets": lora.target_modules}
    return model_identity(config.model.type, {"transformer": model.config, "lora": adapter, **expert_identity(config)})


def expert_identity(config: Any) -> dict[str, str]:
    """The identity entry naming the trained one of two experts (``{"expert": folder}``); empty for ``transformer``,
    so one-transformer pipelines' identities are unchanged. Shared by the trainer and ``runtime.rl``."""
    folder = transformer_folder(config)
    return {} if folder == "transformer" else {"expert": folder}


def warn_small_buckets(buckets: Any, batch_size: int, video: bool) -> None:
    """Samples of a bucket with fewer than ``batch_size`` samples never form a batch: say so rather than drop them
    silently."""
    counts: dict[Any, int] = {}
    for bucket in buckets:
        counts[bucket] = counts.get(bucket, 0) + 1
    for bucket, count in sorted(counts.items()):
        if count < batch_size:
            print(
                f"warning: data.buckets {bucket.as_list(video)} holds {count} sample(s), fewer than data.batch_size="
                f"{batch_size}: they are never trained on",
                file=sys.stderr,
                flush=True,
            )


def checkpointed(model: torch.nn.Module, ema: Any, lora: bool) -> torch.nn.Module | None:
    """What DCP saves: the model (full fine-tuning) or only the adapter modules (LoRA), plus the EMA when kept."""
    if lora:
        from runtime.checkpoint.lora_weights import adapter_modules

        trained = adapter_modules(model)
        return trained if ema is None else ema.wrap(trained)
    return None if ema is None else ema.wrap(model)


def _latent_tokens_of_bucket(bucket: Any, rules: Any) -> int:
    frames = (bucket.frames - 1) // rules.temporal_multiple + 1 if rules.video else 1
    return frames * (bucket.height // rules.pixel_multiple) * (bucket.width // rules.pixel_multiple)


def dit_forward_backward(
    step: int,
    *,
    model: torch.nn.Module,
    sampler: Any,
    conditions: Any,
    condition_model: Any,
    state: ParallelState,
    config: RunConfig,
    device: torch.device,
) -> StepWork:
    """Every micro-batch of step ``step``: conditions, seeded noise, prediction, weighted MSE share, backward."""
    batches = [next(sampler) for _ in range(config.train.micro_batches)]
    global_samples = sum(len(b) for b in batches) * state.dp_size  # every rank takes equally many, equally big
    loss_share = torch.zeros((), device=device, dtype=torch.float32)
    tokens, flops = 0, 0.0
    micro_losses = []
    for micro, batch in enumerate(batches):
        try:
            latents, context = conditions(batch)
        except CacheError as exc:  # a shard changed after the run verified it
            raise ConfigError(f"data.cache: {exc}") from None
        seq_len = latent_tokens(latents[0], condition_model.patch)
        position = micro * state.dp_size + state.dp_rank
        generators = noise_generators(config.model.seed, step, position, len(batch))
        inputs = condition_model.process_condition(latents, context, generators)
        with warnings.catch_warnings():  # FSDP2 warns that unpatchify's view is returned: no in-place op follows
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            prediction = model(**to_device(inputs, device), return_dict=False)[0]
        loss = weighted_flow_matching_loss(prediction, inputs, condition_model, seq_len, global_samples)
        loss.backward()
        loss_share += loss.detach()
        micro_losses.append(loss.detach())
        tokens += seq_len * len(batch)
        flops += dit_flops_per_token(model, seq_len) * seq_len * len(batch)  # this bucket's, not the largest's
    mine = torch.tensor([tokens, flops], dtype=torch.float64, device=device)
    totals = all_reduce_sum(torch.cat([loss_share.double()[None], mine]), state.dp_group)
    return StepWork(
        loss=totals[0].float(),
        count=int(totals[1]),
        processed=int(totals[1]),
        flops=float(totals[2]),
        micro_losses=micro_losses,
        describe=lambda: [[describe_sample(i, conditions) for i in batch] for batch in batches],
    )


def describe_sample(index: int, conditions: Any) -> str:
    """A sample of the data set for a message: its data file:line, and the cache shard its conditions came from."""
    cache = getattr(conditions, "cache", None)
    if cache is not None:
        return cache.describe(conditions.keys[index])
    dataset = getattr(conditions, "dataset", None)
    return dataset.samples[index].where if dataset is not None else f"sample {index}"


def export(config: RunConfig, state: ParallelState, model: torch.nn.Module, ema: Any, peft_config: Any) -> None:
    """The diffusers export (``runtime/checkpoint/diffusers_export.py``): EMA weights when kept, the LoRA file or
    (fused, or full fine-tuning) the whole pipeline directory."""
    from runtime.checkpoint.diffusers_export import export_dit, full_state_dict, pipeline_class
    from runtime.checkpoint.lora_weights import lora_metadata, lora_state_dict, merged_state_dict

    weights = full_state_dict(model)
    if ema is not None:
        averaged = full_state_dict(ema)
        weights.update({ema.parameter_name(k): v for k, v in averaged.items()})
    common = dict(
        pipeline_dir=config.model.path,
        overwrite=config.export.overwrite,
        rank=state.rank,
        component=transformer_folder(config),
        unproven=config.train.self_check.unproven,
    )
    if peft_config is not None and not config.export.fuse_lora:
        lora = (lora_state_dict(weights), lora_metadata(peft_config)) if state.rank == 0 else ({}, {})
        export_dit(config.export.dir, lora=lora, **common)
        loader = hasattr(pipeline_class(config.model.path), "save_lora_weights")  # as export_dit decides
        what = "a LoRA file diffusers' load_lora_weights reads" if loader else "a peft adapter directory"
    else:
        if peft_config is not None and state.rank == 0:
            weights = merged_state_dict(weights, peft_config.lora_alpha / peft_config.r)
        export_dit(config.export.dir, write_weights=lambda d: model.save_pretrained(d, state_dict=weights), **common)
        what = "a diffusers pipeline directory"
    if state.rank == 0:
        print(f"exported {what} to {config.export.dir}", flush=True)


def quiet_loading() -> None:
    """No per-component progress bars from pipeline and encoder loading in the training log."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def check_transformer(config: RunConfig, ulysses: int) -> None:
    """What the transformer must allow, checked on a copy built on the meta device (no weights, no memory) before
    any condition is computed or weight loaded: the Ulysses degree divides its heads (a ring has no head limit),
    ``lora.target_modules`` adapt something."""
    from runtime.diffusion.checkpoint_format import read_config
    from runtime.diffusion.registry import training_class
    from runtime.train.lora import add_lora

    cls = training_class(config.model.type)
    try:
        raw = read_config(
            Path(config.model.path) / transformer_folder(config), cls.config_class.diffusers_class.__name__
        )
        with torch.device("meta"):
            model = cls(cls.config_class(**raw))
    except (OSError, TypeError, ValueError) as exc:
        message = " ".join(str(exc).split())[:300]
        raise ConfigError(f"model.path: {config.model.path}/transformer: {message}") from None
    heads = model.config.num_attention_heads
    if heads % ulysses:
        key = "parallel.ulysses" if config.parallel.ring > 1 else "parallel.sp"
        raise ConfigError(
            f"{key}: the transformer's {heads} attention heads are not divisible by the Ulysses degree {ulysses}; "
            f"choose a divisor of {heads} and grow SP with parallel.ring"
        )
    if config.lora.rank is not None:
        add_lora(model, config.lora)
