"""The policy of an RL run on a generated DiT: the transformer from the pipeline's ``transformer/`` (LoRA through
peft or full fine-tuning, FSDP2 + Ulysses SP when distributed, optional EMA), its frozen condition model, the
Flow-GRPO adapter that drives both, and the reference the KL is measured against.

Everything is the supervised DiT trainer's (``runtime/train/dit.py``): the same loading (unexpected weights refused),
LoRA injection (A seeded alike on every rank), FSDP wrapping, EMA, checkpointed module (the adapter only for LoRA)
and export. What is RL's own: the reference (``lora_disabled``: the policy with its LoRA turned off, no memory;
``frozen_copy``: a frozen copy of the starting weights, sharded like the policy) and the identity a checkpoint
records (the transformer, the LoRA settings and the algorithm: a supervised checkpoint does not resume an RL run).
Of a pipeline with two experts switched at ``boundary_ratio`` (Wan2.2 A14B) the policy is ``dit.condition.expert``'s
and the other expert is loaded frozen, sharded like the reference, for the steps the pipeline runs it on
(``runtime/rl/experts.py``); the identity then names the expert, as the trainer's does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runtime.checkpoint.identity import model_identity, unproven_identity
from runtime.config.errors import ConfigError
from runtime.parallel.state import ParallelState

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig
    from runtime.rl.experts import ExpertSwitch

__all__ = ["Policy", "build_dit_policy", "build_nondiffusers_policy", "build_policy", "lora_disabled"]


@dataclass
class Policy:
    module: nn.Module  # the trained transformer (FSDP2-sharded when distributed)
    adapter: Any  # runtime.rl.adapters.dit.DiTFlowGRPO, or a non-diffusers adapter bound to its tokenizer and VAE
    reference: nn.Module | None  # a frozen copy, or None (lora_disabled, or no KL)
    peft_config: Any  # None for full fine-tuning
    ema: Any
    checkpoint_module: nn.Module  # what checkpoints save (runtime.train.dit.checkpointed)
    identity: dict[str, Any]
    export: Callable[[], None] | None = None  # writes export.dir (collective)
    trained_steps: tuple[int, int] | None = None  # two experts: [lo, hi) of the schedule, the trained expert's

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]


@contextlib.contextmanager
def lora_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` as its base model (every peft LoRA layer off) inside the block; back on after it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no LoRA layers to disable")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield module
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _check_sampling(condition_model: Any, config: RLConfig) -> None:
    from runtime.diffusion.conditions import ConditionModel

    if type(condition_model).encode_prompts is ConditionModel.encode_prompts:
        raise ConfigError(
            f"model.type: the condition model of {config.model.type!r} ({type(condition_model).__name__}) states no "
            f"sampling facts yet (runtime/diffusion/conditions: sampling_latent_shape, encode_prompts, ...)"
        )
    if getattr(condition_model, "i2v", False):
        raise ConfigError(
            f"model.path: {config.model.path} is an image-to-video pipeline; RL runs sample from prompts alone "
            f"(use a text-to-video pipeline)"
        )


def _shard_and_wrap(
    config: RLConfig,
    state: ParallelState,
    device: torch.device,
    module: nn.Module,
    peft_config: Any,
    load: Callable[[str], nn.Module],
) -> tuple[nn.Module, nn.Module | None, Any, nn.Module]:
    """The reference (a frozen copy before sharding, or a teacher ``load``-ed from the algorithm's
    ``teacher_path``), FSDP2 (or checkpointing alone), the EMA and what checkpoints save: the same for every kind of
    policy."""
    from runtime.parallel.parallelize import ParallelPlan, parallelize
    from runtime.rl.config import algorithm
    from runtime.train.dit import checkpointed
    from runtime.train.job import site_plan

    reference = None
    algo = algorithm(config.algorithm)
    needs = algo.needs_reference(config.algo)  # a KL term on; dpo, a distillation teacher: always
    teacher = algo.teacher_path(config.algo) if needs else None
    if teacher is not None:
        try:
            reference = load(teacher).requires_grad_(False).eval()
        except ConfigError as exc:  # the DiT loader names model.path: name the key that gave this path
            raise ConfigError(
                *(f"{config.algorithm}.teacher_model_path: {m.removeprefix('model.path: ')}" for m in exc.messages)
            ) from None
    elif needs and config.reference == "frozen_copy":
        reference = copy.deepcopy(module).requires_grad_(False).eval()
    plan = ParallelPlan(
        mixed_precision=config.train.mixed_precision,  # the trainer's rule (runtime/parallel/precision.py)
        activation_checkpointing=config.parallel.activation_checkpointing,
        **site_plan(config.model.type),
    )
    module = parallelize(module, state, plan, device)  # LoRA is in already: a DiT has no expert parallelism
    if reference is not None:
        reference = shard_frozen(config, state, device, reference)
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError("lora: the policy has no trainable parameter; nothing would be trained")
    ema = None
    if config.dit.ema_decay is not None:
        from runtime.train.ema import EMA

        ema = EMA(module, config.dit.ema_decay).to(device)
    saved = checkpointed(module, ema, lora=peft_config is not None) or module
    return module, reference, ema, saved


def shard_frozen(config: RLConfig, state: ParallelState, device: torch.device, module: nn.Module) -> nn.Module:
    """A frozen module (the reference, the other expert) sharded like the policy: FSDP2 and the same SP sites; no
    activation checkpointing (it is never recomputed)."""
    from runtime.parallel.parallelize import ParallelPlan, parallelize
    from runtime.train.job import site_plan

    plan = ParallelPlan(mixed_precision=config.train.mixed_precision, **site_plan(config.model.type))
    return parallelize(module.requires_grad_(False).eval(), state, plan, device)


def _identity(config: RLConfig, model_type: str, model_config: Any) -> dict[str, Any]:
    """What a checkpoint must match on resume; of two experts the trained one, recorded as the trainer does
    (``{"expert": folder}`` unless ``transformer``): a checkpoint of one expert does not resume the other."""
    lora = config.lora
    adapter = None if lora.rank is None else {"rank": lora.rank, "alpha": lora.alpha, "targets": lora.target_modules}
    from runtime.train.dit import expert_identity

    extra = expert_identity(config) if config.model.architecture is None else {}
    trained = {"model": model_config, "lora": adapter, "algorithm": config.algorithm, **extra}
    return unproven_identity(model_identity(model_type, trained), config.train)


def _add_lora(config: RLConfig, module: nn.Module) -> Any:
    if config.lora.rank is None:
        return None
    from runtime.train.lora import add_lora

    torch.manual_seed(config.model.seed)  # the adapter's initial A: identical on every rank
    return add_lora(module, config.lora)


def build_policy(config: RLConfig, state: ParallelState, device: torch.device) -> Policy:
    """The policy of ``config``: a generated DiT (``model.type``) or a non-diffusers model (``model.architecture``)."""
    if config.model.architecture is not None:
        return build_nondiffusers_policy(config, state, device)
    return build_dit_policy(config, state, device)


def build_nondiffusers_policy(config: RLConfig, state: ParallelState, device: torch.device) -> Policy:
    """A non-diffusers model (``NonDiffusersModelBase.from_pretrained`` of ``model.path``: BAGEL's
    ``ema.safetensors`` names mapped), its adapter with the ``model.adapter`` options, bound to the checkpoint's
    tokenizer (BAGEL's special tokens must be the model's image boundary tokens) and its VAE."""
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer

    from runtime.rl.adapters.registry import get_diffusion_model_cls

    path, algo = config.model.path, config.algo
    cls = get_diffusion_model_cls(config.model.architecture)
    try:
        adapter = cls(**config.model.adapter, noise_level=algo.noise_level, method=algo.sde_type)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.adapter: {config.model.adapter!r}: {' '.join(str(exc).split())[:300]}") from None
    adapter.cps_log_prob = algo.cps_log_prob
    try:
        module = cls.module_class.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae").eval().requires_grad_(False).to(device)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"model.path: cannot load {path}: {' '.join(str(exc).split())[:300]}") from None
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    s = config.sampling
    try:
        adapter.bind(tokenizer, vae, (vae.config.latent_channels, s.height // scale, s.width // scale))
    except KeyError as exc:
        raise ConfigError(f"model.path: {path}: {exc.args[0]}") from None
    boundary = (module.config.get("start_of_image_token_id"), module.config.get("end_of_image_token_id"))
    if boundary != (adapter.new_token_ids["start_of_image"], adapter.new_token_ids["end_of_image"]):
        raise ConfigError(
            f"model.path: {path}: the model's image boundary tokens {boundary} are not the tokenizer's "
            f"<|vision_start|>/<|vision_end|> ({adapter.new_token_ids['start_of_image']}, "
            f"{adapter.new_token_ids['end_of_image']})"
        )
    peft_config = _add_lora(config, module)
    module, reference, ema, saved = _shard_and_wrap(config, state, device, module, peft_config, _loader(cls))
    policy = Policy(
        module=module,
        adapter=adapter,
        reference=reference,
        peft_config=peft_config,
        ema=ema,
        checkpoint_module=saved,
        identity=_identity(config, config.model.architecture, dict(module.config)),
    )
    policy.export = functools.partial(export_nondiffusers, config, state, policy)
    return policy


def _loader(cls: Any) -> Callable[[str], nn.Module]:
    """A teacher of the non-diffusers adapter ``cls``'s module class from another checkpoint directory."""

    def load(path: str) -> nn.Module:
        try:
            return cls.module_class.from_pretrained(path)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ConfigError(f"cannot load {path}: {' '.join(str(exc).split())[:300]}") from None

    return load


def export_nondiffusers(config: RLConfig, state: ParallelState, policy: Policy) -> None:
    """``export.dir``: a copy of the checkpoint directory with the trained weights (EMA when kept, LoRA merged) in
    its own format (BAGEL's ``ema.safetensors`` names), which ``from_pretrained`` (and BAGEL's loader, by name)
    reads; written as a temporary sibling and renamed into place (the export rules of runtime/checkpoint)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    from runtime.checkpoint.dcp import replace_dir_atomically
    from runtime.checkpoint.diffusers_export import full_state_dict
    from runtime.checkpoint.export import _write_marker, check_export_target
    from runtime.checkpoint.lora_weights import merged_state_dict
    from runtime.rl.adapters.bagel.checkpoint import BAGEL_WEIGHTS_NAME, to_bagel_keys
    from runtime.rl.adapters.nondiffusers import WEIGHTS_NAME

    weights = full_state_dict(policy.module)
    if policy.ema is not None:
        weights.update({policy.ema.parameter_name(k): v for k, v in full_state_dict(policy.ema).items()})
    out = check_export_target(config.export.dir, overwrite=config.export.overwrite)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier()
    if state.rank == 0:
        if policy.peft_config is not None:
            weights = merged_state_dict(weights, policy.peft_config.lora_alpha / policy.peft_config.r)
        source, tmp = Path(config.model.path), out.with_name(f".{out.name}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write_marker(tmp, config.train.self_check.unproven)
        for entry in sorted(source.iterdir()):
            if entry.name.startswith(".") or entry.name in (BAGEL_WEIGHTS_NAME, WEIGHTS_NAME):
                continue
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
        tensors = {k: v.contiguous() for k, v in to_bagel_keys(weights).items()}
        save_file(tensors, str(tmp / BAGEL_WEIGHTS_NAME), metadata={"format": "pt"})
        _write_marker(tmp, config.train.self_check.unproven)
        replace_dir_atomically(tmp, out)
        print(f"exported a {config.model.architecture} checkpoint directory to {out}", flush=True)
    if distributed:
        dist.barrier()


def build_dit_policy(config: RLConfig, state: ParallelState, device: torch.device) -> Policy:
    """The policy of ``config`` (an ``RLConfig``) on ``device``, sharded over ``state``'s ranks."""
    from runtime.rl.adapters.dit import adapter_for
    from runtime.train.dit import check_transformer, export, load_condition_model_for, load_transformer, quiet_loading

    quiet_loading()
    check_transformer(config, state.ulysses_size)  # ulysses divides the heads; the LoRA targets adapt something
    condition_model = load_condition_model_for(config, encoders=True, device=device)
    _check_sampling(condition_model, config)
    s = config.sampling
    latent_shape = condition_model.sampling_latent_shape(s.height, s.width, s.frames)
    algo = config.algo
    adapter = adapter_for(config.model.type)(
        condition_model,
        latent_shape,
        true_cfg_scale=s.true_cfg_scale,
        true_cfg_scale_2=s.true_cfg_scale_2,
        noise_level=algo.noise_level,
        method=algo.sde_type,
        cps_log_prob=algo.cps_log_prob,
    )

    module = load_transformer(config)
    peft_config = _add_lora(config, module)

    def teacher(path: str) -> nn.Module:  # the same model type from another pipeline directory
        return load_transformer(dataclasses.replace(config, model=dataclasses.replace(config.model, path=path)))

    module, reference, ema, saved = _shard_and_wrap(config, state, device, module, peft_config, teacher)
    adapter.experts = _expert_switch(config, state, device, condition_model)
    policy = Policy(
        module=module,
        adapter=adapter,
        reference=reference,
        peft_config=peft_config,
        ema=ema,
        checkpoint_module=saved,
        identity=_identity(config, config.model.type, module.config),
        trained_steps=None if adapter.experts is None else adapter.experts.steps(s.num_inference_steps),
    )
    # the trained expert to its folder, the other copied as it was (runtime/train/dit.py: transformer_folder)
    policy.export = functools.partial(export, config, state, module, ema, peft_config)
    return policy


def _expert_switch(
    config: RLConfig, state: ParallelState, device: torch.device, condition_model: Any
) -> ExpertSwitch | None:
    """Of a pipeline with two experts (``dit.condition.expert``), the other one frozen and sharded, and the steps
    each runs (``runtime/rl/experts.py``); None for one transformer."""
    from runtime.rl.experts import ExpertSwitch, other_expert
    from runtime.train.dit import load_transformer

    expert = getattr(condition_model, "expert", None)
    if expert is None:
        return None
    condition = {**config.dit.condition, "expert": other_expert(expert)}
    other = load_transformer(dataclasses.replace(config, dit=dataclasses.replace(config.dit, condition=condition)))
    pipeline = condition_model.pipeline
    ratio = float(pipeline.config.boundary_ratio)
    return ExpertSwitch(shard_frozen(config, state, device, other), expert, ratio, pipeline.scheduler)
