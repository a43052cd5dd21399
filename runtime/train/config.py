"""Run configuration: YAML -> frozen dataclasses, validated with one-line errors that name the key.

Example (every key shown with its default unless marked required)::

    model:
      type: qwen3              # required: HF model_type with a generated class (runtime/models/registry.py)
      path: null               # local HF checkpoint; null = random init from `config`
      config: {}               # overrides for random init (AutoConfig.for_model(type, **config))
      seed: 0
      attn_implementation: sdpa  # eager | sdpa | flex_attention | flash_attention_2/3/4 (where flash-attn is
                                 # installed); DiTs: sdpa (the processors' own) or a diffusers attention backend
      experts_implementation: patchgen_grouped  # MoE models: eager | patchgen_grouped | patchgen_triton
      freeze_vision: false     # vision-language models: train without updating the vision tower
      freeze_audio: false      # omni models: train without updating the audio encoder
    data:
      path: data.jsonl         # required: .jsonl (text / chat messages, with images/videos for VLMs) or .txt
      tokenizer: tok/          # required for text models: local tokenizer directory
      processor: proc/         # required for vision-language models instead: local processor directory
      token_budget: 1024       # tokens per packed row (one row per micro-batch per DP replica)
      seed: 0
      media_dir: null          # VLM/omni/DiT data: media paths resolve against (and must stay inside) the data
                               # file's directory; a directory here replaces it (absolute paths inside it allowed)
    parallel: {sp: 1, ep: 1, dp_replicate: 1, dp_shard: null, activation_checkpointing: false,
               overlap: false}  # overlap: asynchronous Ulysses all-to-alls (bitwise-equal results)
               # ulysses: u, ring: r (sp = u x r; any two of the three): ring attention past the head count
    optim: {name: adamw_torch, lr: 3.0e-4, weight_decay: 0.0, betas: [0.9, 0.95], eps: 1.0e-8, max_grad_norm: 1.0,
            lr_scheduler_type: cosine_with_min_lr, warmup_steps: 0, min_lr_ratio: 0.1}
            # name: adamw_torch | adamw_torch_fused | adafactor | sgd (HF TrainingArguments' optim values);
            # lr_scheduler_type: cosine_with_min_lr | cosine | linear | constant | constant_with_warmup
    train: {steps: 100, micro_batches: 1, loss_chunk_size: null, nonfinite: stop,  # nonfinite: stop | skip
            compile: false,    # compile: torch.compile every transformer block (runtime/parallel/compile.py)
            mixed_precision: auto}  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32; bf16: bf16 parameters and
                                    # compute, fp32 gradient reduction, fp32 master weights and optimizer state
    checkpoint: {dir: null, interval: 0, resume: auto, save_total_limit: 2}
    log: {dir: runs/latest, interval: 1, report_to: [], project: patchgen, run_name: null, peak_tflops: null,
          progress: true}      # report_to: tensorboard, wandb, mlflow; metrics.jsonl is always written
    export: {dir: null, overwrite: false, fuse_lora: false}  # write a plain-transformers checkpoint at the end;
                               # overwrite replaces an earlier export (a directory the exporter wrote), never anything
                               # else; LoRA runs write the adapter, or with fuse_lora the merged weights
    lora: {rank: null, alpha: null, dropout: 0.0, target_modules: null, target_parameters: null}
                               # rank null: full fine-tuning; target_modules null: the family's default
    eval: {path: null, every_steps: 0, max_batches: null}  # a held-out set's loss every every_steps (0: at the end)

Diffusion transformers (``model.type`` of a ``family = "dit"`` spec, e.g. wan, flux, hunyuanvideo) read other keys::

    model:
      type: wan
      path: pipelines/wan      # required: a diffusers pipeline directory (model_index.json, transformer/, VAE,
                               # text encoders, scheduler); the transformer starts from its transformer/ weights
    data:
      path: clips.jsonl        # {"caption": ..., "video": clip.mp4 | frame folder | [frames]} or {"image": ...}
      buckets: [[9, 64, 64]]   # required: [frames, height, width] (video models) or [height, width] (image models)
      batch_size: 1            # samples per micro-batch per DP replica (one bucket per micro-batch)
      frame_stride: 1          # take every n-th frame of a video
      cache: null              # directory of cached conditions (latents + embeddings); null: computed every step
      seed: 0
    lora: {rank: null, alpha: null, target_modules: null}  # null: [to_q, to_k, to_v, to_out.0]; rank null: full
    validation: {prompts: null, every_steps: 0, num_inference_steps: 8, guidance_scale: null, seed: 0}
                               # sample images/videos of these prompts from the current weights (0: at the end)
    dit:
      ema_decay: null          # e.g. 0.999: keep an EMA of the trained weights (checkpointed; the export uses it)
      condition: {}            # condition-model options: noise-level recipe (TimestepSampler fields: distribution,
                               # shift, weighting, ...), Flux's guidance_scale
    export: {dir: null, overwrite: false, fuse_lora: false}  # DiTs: a diffusers pipeline directory (full weights)
                               # or, with LoRA, pytorch_lora_weights.safetensors (fuse_lora: full weights instead)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.train.config_shape import MAX_CONFIG_DEPTH, shape_problem
from runtime.train.model_keys import model_config_problems, model_type_problem
from runtime.train.overrides import Override, apply_overrides, override_of
from runtime.train.tracking.requirements import missing_backend


class ConfigError(ValueError):
    """A user error in the run configuration or parallel layout (exit code 2): one message, or every message of a
    config with several errors (``messages``, one line each; ``str`` joins them with newlines)."""

    def __init__(self, *messages: str) -> None:
        super().__init__("\n".join(messages))
        self.messages = list(messages)


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading ``1e-4`` as a float, as YAML 1.2 does (YAML 1.1 wants ``1.0e-4`` and PyYAML
    reads ``lr: 1e-4`` as a string)."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass(frozen=True)
class ModelConfig:
    type: str
    path: str | None = None
    config: dict = field(default_factory=dict)
    seed: int = 0
    attn_implementation: str = "sdpa"
    experts_implementation: str = "patchgen_grouped"  # MoE models only: eager | patchgen_grouped | patchgen_triton
    freeze_vision: bool = False  # vision-language models only
    freeze_audio: bool = False  # omni models (an audio encoder) only


@dataclass(frozen=True)
class DataConfig:
    path: str
    tokenizer: str | None = None  # text models
    processor: str | None = None  # vision-language models (tokenizer + image/video processors)
    token_budget: int = 1024
    seed: int = 0
    buckets: list | None = None  # DiTs: [[frames, height, width], ...] or [[height, width], ...]
    batch_size: int = 1  # DiTs: samples per micro-batch per DP replica
    frame_stride: int = 1  # DiTs: every n-th video frame
    cache: str | None = None  # DiTs: condition cache directory (null: conditions computed every step)
    media_dir: str | None = None  # where media paths resolve and must stay (null: the data file's directory)


@dataclass(frozen=True)
class ParallelConfig:
    """``sp = ulysses x ring``: ``sp`` alone is Ulysses only; any two of the three give the third (``sp: 1``, the
    default, counts as not given). After construction all three are set and consistent."""

    sp: int = 1
    ulysses: int | None = None  # the head-splitting (all-to-all) SP degree
    ring: int | None = None  # the ring-attention SP degree (no head constraint)
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int | None = None
    activation_checkpointing: bool = False
    # issue the Ulysses all-to-alls asynchronously (runtime/sp/overlap.py): bitwise-equal results, off by default
    overlap: bool = False

    def __post_init__(self) -> None:
        ulysses, ring = _usp_degrees(self.sp, self.ulysses, self.ring)
        object.__setattr__(self, "sp", ulysses * ring)
        object.__setattr__(self, "ulysses", ulysses)
        object.__setattr__(self, "ring", ring)


def _usp_degrees(sp: int, ulysses: int | None, ring: int | None) -> tuple[int, int]:
    """(ulysses, ring) from the three ``parallel`` keys (sp 1 counts as not given); a ConfigError naming the keys
    when they disagree. Values that are not positive integers are left to the key rules (reported there)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (sp, ulysses or 1, ring or 1)):
        return 1, 1
    if ulysses is None and ring is None:
        return sp, 1
    if ulysses is not None and ring is not None:
        if sp not in (1, ulysses * ring):
            raise ConfigError(
                f"parallel.sp: {sp} must equal parallel.ulysses x parallel.ring = {ulysses} x {ring} (give two of "
                "the three)"
            )
        return ulysses, ring
    given, name = (ulysses, "ulysses") if ulysses is not None else (ring, "ring")
    if sp == 1:
        sp = given
    if sp % given:
        raise ConfigError(f"parallel.{name}: {given} must divide parallel.sp = {sp} (sp = ulysses x ring)")
    other = sp // given
    return (given, other) if name == "ulysses" else (other, given)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # HF TrainingArguments' name (0: no clipping)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine_with_min_lr: the lr the cosine ends at, over lr (transformers' min_lr_rate)
    name: str = "adamw_torch"  # HF TrainingArguments' `optim` values (OPTIMIZERS below)
    lr_scheduler_type: str = "cosine_with_min_lr"  # transformers.get_scheduler's names (OPTIMIZERS, SCHEDULERS below)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    micro_batches: int = 1
    loss_chunk_size: int | None = None
    # a non-finite loss or gradient norm: "stop" the run (exit 2, naming the step and its samples) or "skip" the
    # optimizer step (counted in the metrics as `skipped_nonfinite`); never an update with a non-finite value
    nonfinite: str = "stop"
    compile: bool = False  # torch.compile each transformer block, as torchtitan (runtime/parallel/compile.py)
    # auto: bf16 parameters/compute with fp32 gradient reduction and fp32 master weights on GPU, fp32 on CPU;
    # bf16 / fp32: that, on any device (accelerate's --mixed_precision, torchtitan's mixed_precision_param)
    mixed_precision: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    interval: int = 0
    resume: str | None = "auto"  # "auto": newest intact checkpoint in dir, null: start fresh, or a path
    save_total_limit: int = 2  # checkpoints kept (HF TrainingArguments' name; torchtitan: keep_latest_k)


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs/latest"
    interval: int = 1
    report_to: list = field(default_factory=list)  # HF TrainingArguments' name: tensorboard, wandb, mlflow
    project: str = "patchgen"  # the W&B project / MLflow experiment
    run_name: str | None = None  # null: the name of log.dir
    peak_tflops: float | None = None  # per device, for MFU; auto-detected on known GPUs
    progress: bool = True


@dataclass(frozen=True)
class ExportConfig:
    dir: str | None = None
    overwrite: bool = False  # replace an earlier export in `dir` (other directories are always refused)
    fuse_lora: bool = False  # LoRA runs: export full weights with the LoRA merged instead of the adapter


@dataclass(frozen=True)
class LoraConfig:
    rank: int | None = None  # null: full fine-tuning
    alpha: float | None = None  # null: = rank (scale 1)
    dropout: float = 0.0
    target_modules: list | str | None = None  # null: the family's default (runtime/train/lora.py)
    target_parameters: list | None = None  # parameters adapted directly (peft's name), e.g. MoE experts' weights


@dataclass(frozen=True)
class EvalConfig:
    """A held-out set whose loss is measured every ``every_steps`` steps and at the end (HF: eval_dataset,
    eval_steps; torchtitan: validation.freq, validation.steps)."""

    path: str | None = None  # same format as data.path; null: no eval
    every_steps: int = 0  # 0: only at the end of the run
    max_batches: int | None = None  # null: the whole eval set


@dataclass(frozen=True)
class ValidationConfig:
    """DiTs: sample images/videos from the current weights through the plain diffusers pipeline."""

    prompts: list | None = None  # null: no validation samples
    every_steps: int = 0  # 0: only at the end of the run
    num_inference_steps: int = 8
    guidance_scale: float | None = None  # null: the pipeline's default
    seed: int = 0


@dataclass(frozen=True)
class DiTConfig:
    ema_decay: float | None = None
    condition: dict = field(default_factory=dict)  # condition-model options (noise-level recipe, guidance_scale)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)


_POSITIVE = {
    "data.token_budget",
    "train.steps",
    "train.micro_batches",
    "parallel.sp",
    "parallel.ulysses",
    "parallel.ring",
    "parallel.ep",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "train.loss_chunk_size",
    "log.interval",
    "checkpoint.save_total_limit",
    "data.batch_size",
    "data.frame_stride",
    "lora.rank",
    "lora.alpha",
    "eval.max_batches",
    "validation.num_inference_steps",
    "validation.guidance_scale",
    "log.peak_tflops",
}
_NON_NEGATIVE = {
    "optim.lr",
    "optim.weight_decay",
    "optim.max_grad_norm",
    "optim.eps",
    "optim.warmup_steps",
    "checkpoint.interval",
    "model.seed",
    "data.seed",
    "eval.every_steps",
    "validation.every_steps",
    "validation.seed",
}
_UNIT_INTERVAL = {"optim.min_lr_ratio", "lora.dropout"}  # ratios: [0, 1]

# Every integer of a run config fits a signed 64-bit value (seeds, counts and ids end up in torch tensors).
MAX_INT = 2**63 - 1
# A run config is a page of YAML: anything larger or deeper is not one (and would only cost time to parse).
MAX_CONFIG_BYTES = 1 << 20

# Attention implementations a training forward can use (transformers' AttentionInterface on 5.14.1 plus eager; the
# runtime's own `ulysses_<name>` wrappers are chosen by the runtime under SP, never named in a config), and the
# module each flash-attention implementation imports (absent on CPU machines).
ATTN_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
_ATTN_MODULES = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
    "flash_attention_4": "flash_attn",
}
# diffusers 0.40.0's AttentionBackendName values (a DiT's `attention_backend`), listed here so that a config is
# checked without importing diffusers (and torch); tests/hostile/test_train_config.py compares them with the enum.
DIFFUSERS_ATTENTION_BACKENDS = (
    "flash",
    "flash_hub",
    "flash_varlen",
    "flash_varlen_hub",
    "flash_4_hub",
    "_flash_3",
    "_flash_varlen_3",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
    "aiter_fa2_hub",
    "flex",
    "native",
    "_native_cudnn",
    "_native_efficient",
    "_native_flash",
    "_native_math",
    "_native_npu",
    "_native_xla",
    "sage",
    "sage_hub",
    "sage_varlen",
    "_sage_qk_int8_pv_fp8_cuda",
    "_sage_qk_int8_pv_fp8_cuda_sm90",
    "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton",
    "xformers",
)
EXPERTS_IMPLEMENTATIONS = ("eager", "patchgen_grouped", "patchgen_triton")  # runtime/moe/dispatch.py
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd")  # HF TrainingArguments' `optim` names
# transformers.get_scheduler's names (SchedulerType) that need no more than warmup, the step count and min_lr_ratio
SCHEDULERS = ("cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "bf16", "fp32")
REPORT_TO = ("tensorboard", "wandb", "mlflow")
_CHOICES = {
    "train.nonfinite": ("stop", "skip"),
    "model.experts_implementation": EXPERTS_IMPLEMENTATIONS,
    "optim.name": OPTIMIZERS,
    "optim.lr_scheduler_type": SCHEDULERS,
    "train.mixed_precision": MIXED_PRECISION,
}
# Keys renamed to the names HF TrainingArguments / torchtitan users know: an old name is refused with the new one.
RENAMED = {
    "optim.grad_clip": "optim.max_grad_norm",
    "checkpoint.keep": "checkpoint.save_total_limit",
    "log.tensorboard": "log.report_to (a list: [tensorboard])",
    "dit.lora": "lora (a top-level section, for every model family)",
}


@dataclass(frozen=True)
class KeyRules:
    """Range and choice rules of dotted keys, checked while a section is built (``build_section``): the trainer's
    (``TRAIN_RULES``) and, merged with them, another command's over its own keys (``runtime/rl/config.py``)."""

    positive: frozenset = frozenset()
    non_negative: frozenset = frozenset()
    unit_interval: frozenset = frozenset()  # ratios: [0, 1]
    choices: dict = field(default_factory=dict)

    def merged(self, other: KeyRules) -> KeyRules:
        return KeyRules(
            self.positive | other.positive,
            self.non_negative | other.non_negative,
            self.unit_interval | other.unit_interval,
            {**self.choices, **other.choices},
        )


TRAIN_RULES = KeyRules(frozenset(_POSITIVE), frozenset(_NON_NEGATIVE), frozenset(_UNIT_INTERVAL), dict(_CHOICES))


def _shown(value: Any) -> str:
    return f"{value!r:.60}"


def _number_problem(value: Any, key: str) -> str | None:
    """Finite floats and 64-bit integers only: a NaN or infinite learning rate trains NaN, a 100-digit seed is an
    overflow deep inside torch."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: must be a finite number, found {value}"
    if isinstance(value, int) and not -MAX_INT - 1 <= value <= MAX_INT:
        return f"{key}: must fit in 64 bits (-2**63 <= value < 2**63), found {_shown(value)}"
    return None


def _check_number(value: Any, key: str) -> None:
    problem = _number_problem(value, key)
    if problem:
        raise ConfigError(problem)


def _numbers_within(value: Any, key: str) -> list[str]:
    """``_number_problem`` of every number in a mapping or list value (``model.config``, ``dit.condition``)."""
    stack, seen, found = [(value, key)], set(), []
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict | list):
            if id(item) in seen:  # YAML aliases share objects: walk each once
                continue
            seen.add(id(item))
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((v, f"{where}.{k}" if isinstance(item, dict) else f"{where}[{k}]") for k, v in pairs)
        else:
            problem = _number_problem(item, where)
            if problem:
                found.append(problem)
    return sorted(found)


def _check_choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}: unknown value {_shown(value)}; expected one of {', '.join(choices)}{hint}")


def _check_type(value: Any, annotation: Any, key: str) -> Any:
    hint = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None:
        if type(None) in hint:
            return None
        raise ConfigError(f"{key}: must not be null")
    _check_number(value, key)
    for kind in hint:
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if (
            kind in (int, str, bool, list, dict)
            and isinstance(value, kind)
            and not (kind is int and isinstance(value, bool))
        ):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in hint if k is not type(None))
    raise ConfigError(f"{key}: expected {names}, found {type(value).__name__} {value!r}")


def message_key(message: str) -> str | None:
    """The dotted key a one-line error starts with (``data.buckets[2]: ...`` -> ``data.buckets``)."""
    match = _KEY_PREFIX.match(message)
    return match.group(1) if match else None


class ConfigErrors:
    """The errors of one config, collected so that all are reported at once. A key whose value was refused is
    replaced by its default while the other checks go on; what a later check says about a refused key (or a key
    inside it) is dropped, as a consequence of the first error rather than another one."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.refused: list[str] = []

    def _covered(self, key: str) -> bool:
        return any(key == bad or key.startswith((bad + ".", bad + "[")) for bad in self.refused)

    def add(self, *messages: str) -> None:
        for message in messages:
            key = message_key(message)
            if key is not None and self._covered(key):
                continue
            self.messages.append(message)
            if key is not None:
                self.refused.append(key)

    def run(self, check: typing.Callable[[], None]) -> None:
        """Run one check, keeping what it raises. A check that fails otherwise on the defaults put in place of
        refused values is skipped when errors were found already (those errors are the ones to report)."""
        try:
            check()
        except ConfigError as exc:
            self.add(*exc.messages)
        except Exception:
            if not self.messages:
                raise

    def raise_if_any(self) -> None:
        if self.messages:
            raise ConfigError(*self.messages)


def unknown_key_message(prefix: str, name: str, fields: typing.Iterable[str]) -> str:
    """``<key>: unknown key`` with the nearest known key of the section (a renamed key's new name included)."""
    key = f"{prefix}.{name}" if prefix else name
    if key in RENAMED:
        return f"{key}: renamed to {RENAMED[key]}"
    fields = list(fields)
    renamed = {old.rpartition(".")[2]: new for old, new in RENAMED.items() if old.rpartition(".")[0] == prefix}
    close = difflib.get_close_matches(str(name), [*fields, *renamed], n=1, cutoff=0.6)
    hint = ""
    if close and close[0] in renamed:
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}, now {renamed[close[0]]}?"
    elif close:
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    return f"{key}: unknown key{hint} (expected one of {', '.join(fields)})"


def _check_rules(value: Any, key: str, rules: KeyRules) -> None:
    if value is not None and key in rules.positive and value <= 0:
        raise ConfigError(f"{key}: must be positive, found {value}")
    if value is not None and key in rules.non_negative and value < 0:
        raise ConfigError(f"{key}: must not be negative, found {value}")
    if value is not None and key in rules.unit_interval and not 0 <= value <= 1:
        raise ConfigError(f"{key}: expected a ratio in [0, 1], found {value}")
    if key in rules.choices:
        _check_choice(value, key, rules.choices[key])


def collect_section(cls: type, raw: Any, prefix: str, rules: KeyRules, errors: ConfigErrors) -> Any:
    """``build_section`` that adds every error to ``errors`` and always returns a ``cls``: a refused value is
    replaced by its default (a required one by None) so that the checks across sections still run."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict):
        errors.add(f"{prefix or 'config'}: expected a mapping, found {type(raw).__name__}")
        raw = {}
    hints = typing.get_type_hints(cls)
    errors.add(*(unknown_key_message(prefix, name, fields) for name in sorted(set(raw) - set(fields), key=str)))
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in raw:
            if required:
                errors.add(f"{key}: required key missing")
                values[name] = None
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = collect_section(hint, raw[name], key, rules, errors)
            continue
        try:
            value = _check_type(raw[name], hint, key)
            _check_rules(value, key, rules)
        except ConfigError as exc:
            errors.add(*exc.messages)
            if required:
                values[name] = None
            continue
        if isinstance(value, dict | list):
            errors.add(*_numbers_within(value, key))  # the value is kept: its keys are checked further on
        values[name] = value
    return cls(**values)


def build_section(cls: type, raw: Any, prefix: str, rules: KeyRules = TRAIN_RULES) -> Any:
    """The frozen dataclass ``cls`` from the mapping ``raw`` (the section at dotted ``prefix``): unknown and missing
    keys, types, numbers and ``rules`` checked; every error of the section in one ``ConfigError``, one line each,
    naming its key."""
    errors = ConfigErrors()
    section = collect_section(cls, raw, prefix, rules, errors)
    errors.raise_if_any()
    return section


def parse_config(raw: Any) -> RunConfig:
    """The run config of the loaded YAML ``raw``; every error found in one ``ConfigError`` (``messages``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, found {type(raw).__name__}")
    errors = ConfigErrors()
    config = collect_section(RunConfig, raw, "", TRAIN_RULES, errors)
    for check in (
        _check_betas,
        _check_model_type,
        _check_attention,
        _check_family_keys,
        _check_model_kind,
        _check_model_config,
        _check_outputs,
    ):
        errors.run(lambda check=check: check(config))
    errors.raise_if_any()
    return config


def _check_betas(config: Any) -> None:
    betas = config.optim.betas
    if len(betas) != 2 or not all(
        isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
    ):
        raise ConfigError(f"optim.betas: expected two numbers in [0, 1), found {betas!r}")


def _check_outputs(config: RunConfig) -> None:
    errors = ConfigErrors()
    if config.checkpoint.interval and not config.checkpoint.dir:
        errors.add("checkpoint.interval: set checkpoint.dir to say where checkpoints go")
    for index, name in enumerate(config.log.report_to):
        errors.run(lambda index=index, name=name: _check_choice(name, f"log.report_to[{index}]", REPORT_TO))
        missing = missing_backend(name)  # find_spec only: no tracker (nor torch) imported
        if missing:
            errors.add(f"log.report_to[{index}]: {missing}")
    if config.export.fuse_lora and config.lora.rank is None:
        errors.add("export.fuse_lora: only for LoRA runs (set lora.rank)")
    errors.raise_if_any()


def _registry_entry(config: RunConfig) -> Any:
    from runtime.models.registry import REGISTRY

    return REGISTRY.get(config.model.type) if isinstance(config.model.type, str) else None


def _check_model_type(config: RunConfig) -> None:
    """A model type with a generated class (``runtime/models/registry.py``: generated ``*.model.json`` records)."""
    problem = model_type_problem(config.model.type)
    if problem:
        raise ConfigError(problem)


def _check_family_keys(config: RunConfig) -> None:
    """Keys that only DiTs read, or that DiTs do not read."""
    entry = _registry_entry(config)
    if entry is None:
        return
    if entry.family == "dit":
        _check_dit(config)
    else:
        _check_not_dit(config)


def _check_model_kind(config: RunConfig) -> None:
    """Text models read a tokenizer, vision-language models a processor; freeze_vision needs a vision tower."""
    entry = _registry_entry(config)
    if entry is None or entry.family == "dit":
        return  # _check_model_type names the known types; DiTs: _check_dit
    if entry.is_vlm:
        if config.data.processor is None:
            raise ConfigError(
                f"data.processor: required for the vision-language model {config.model.type!r} (a local "
                f"processor directory: tokenizer with vision tokens + image/video processors)"
            )
        if config.data.tokenizer is not None:
            raise ConfigError(
                "data.tokenizer: a vision-language model reads its tokenizer from data.processor; "
                "remove data.tokenizer"
            )
    else:
        if config.data.tokenizer is None:
            raise ConfigError("data.tokenizer: required key missing")
        if config.data.processor is not None:
            raise ConfigError(
                f"data.processor: only vision-language models take a processor; {config.model.type!r} "
                f"is a text model (use data.tokenizer)"
            )
        if config.model.freeze_vision:
            raise ConfigError(f"model.freeze_vision: {config.model.type!r} has no vision tower")
        if config.data.media_dir is not None:
            raise ConfigError(f"data.media_dir: {config.model.type!r} is a text model; its data has no media files")
    if config.model.freeze_audio and not entry.has("audio"):
        raise ConfigError(f"model.freeze_audio: {config.model.type!r} has no audio encoder")


def _check_attention(config: RunConfig) -> None:
    """A known attention implementation, and for flash attention its package (a CPU machine has none): transformers
    would say so only when the model is built, in a multi-line error."""
    entry = _registry_entry(config)
    name = config.model.attn_implementation
    if entry is not None and entry.family == "dit":
        # diffusers' attention backends (`attention_backend=`); sdpa keeps the processors' own attention
        _check_choice(name, "model.attn_implementation", ("sdpa", *DIFFUSERS_ATTENTION_BACKENDS))
        return
    _check_choice(name, "model.attn_implementation", ATTN_IMPLEMENTATIONS)
    module = _ATTN_MODULES.get(name)
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"model.attn_implementation: {name} needs the {module} package, which is not installed here "
            f"(the gpu extra, CUDA machines only); use sdpa"
        )


def _check_model_config(config: RunConfig) -> None:
    """``model.config`` sets a random init's config: every key must be one its config class knows (read from
    transformers' source, without importing it: ``runtime/train/config_source.py``), and every size in it lies
    within ``runtime/train/model_limits.py``'s bounds."""
    model = config.model
    if model.path is not None and model.config:
        raise ConfigError(
            "model.config: sets the config of a random init, but model.path is set (its config.json is used); "
            "remove model.config or model.path"
        )
    entry = _registry_entry(config)
    if not model.config or entry is None or entry.family == "dit":
        return  # an unknown type: _check_model_type names the known ones; DiTs: _check_dit
    errors = ConfigErrors()
    errors.add(*model_config_problems(model.type, entry.module, model.config))
    errors.raise_if_any()


_KEY_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\[\d+\])*:")  # `data.buckets[2]:` is data.buckets


def key_line(path: Path, dotted: str) -> int | None:
    """The 1-based line of the deepest key of ``dotted`` (``a.b.c``) that the YAML file ``path`` spells out."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        match = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        if match is None:
            break
        line = next(k for k, v in node.value if v is match).start_mark.line + 1
        node = match
    return line


def locate_error(message: str, path: Path) -> str:
    """``message`` (starting with the dotted key it concerns) prefixed with the config file and the key's line."""
    match = _KEY_PREFIX.match(message)
    line = key_line(path, match.group(1)) if match else None
    return f"{path}:{line}: {message}" if line else f"{path}: {message}"


def _read_text(path: Path) -> str:
    """The config file's text: a UTF-8 file of at most ``MAX_CONFIG_BYTES``, else a one-line ``ConfigError``."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: not a file (expected a YAML run config)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: more than {MAX_CONFIG_BYTES} bytes (1 MiB), the limit for a run config; is it the right file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None


def read_config_file(path: str | Path) -> Any:
    """The YAML data of a run config file, refused in one line (``ConfigError`` naming the file) when it is not a
    readable UTF-8 file of at most ``MAX_CONFIG_BYTES``, not YAML, or too deep or too large once expanded."""
    path = Path(path)
    text = _read_text(path)
    try:
        raw = yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:  # deeper than Python's recursion limit, which is above MAX_CONFIG_DEPTH
        raise ConfigError(
            f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep, the limit for a run config"
        ) from None
    except ValueError as exc:  # a value YAML parses but Python cannot hold (e.g. an integer of 5000 digits)
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    problem = shape_problem(raw)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return raw


def locate_errors(
    exc: ConfigError,
    path: Path,
    overrides: Sequence[Override] = (),
    locate: typing.Callable[[str, Path], str] = locate_error,
) -> ConfigError:
    """Every message of ``exc`` with where its key was set: the command-line override that set it (``override
    --train.steps: ...``), else the config file and the key's line (``locate``)."""
    out: list[str] = []
    for message in exc.messages:
        key = message_key(message)
        item = override_of(key, overrides) if key and not message.startswith("override --") else None
        if item is None:
            out.append(message if message.startswith("override --") else locate(message, path))
        elif message.startswith(f"{item.key}:"):
            out.append(f"override --{item.key}:{message[len(item.key) + 1 :]}")
        else:
            out.append(f"override --{item.key}: {message}")
    prefix = f"{path}:"

    def line(message: str) -> float:  # the file's errors in the order of their lines, then the overrides'
        number = message[len(prefix) :].partition(":")[0] if message.startswith(prefix) else ""
        return int(number) if number.isdigit() else math.inf

    return ConfigError(*sorted(out, key=line))


def load_config(
    path: str | Path,
    overrides: Sequence[Override] = (),
    parse: typing.Callable[[Any], Any] = parse_config,
    locate: typing.Callable[[str, Path], str] = locate_error,
) -> Any:
    """The run config in the YAML file ``path`` with the command-line ``overrides`` set, read by ``parse`` (the
    trainer's ``RunConfig`` by default; the RL job passes its own); every error of it in one ``ConfigError``, each
    message naming the file and line (``locate``) or the override, and the key."""
    path = Path(path)
    raw, problems = apply_overrides(read_config_file(path), overrides)
    if problems:
        raise ConfigError(*problems)
    try:
        return parse(raw)
    except ConfigError as exc:
        raise locate_errors(exc, path, overrides, locate) from None


def _check_dit(config: RunConfig) -> None:
    """A DiT reads a pipeline directory and bucketed media; the tokenizer/processor keys belong to other models."""
    kind = config.model.type
    for key in ("tokenizer", "processor"):
        if getattr(config.data, key) is not None:
            raise ConfigError(
                f"data.{key}: the DiT {kind!r} reads its text encoders from model.path (a diffusers pipeline "
                f"directory); remove data.{key}"
            )
    if config.model.path is None:
        raise ConfigError(
            f"model.path: required for the DiT {kind!r}: a diffusers pipeline directory (model_index.json, "
            f"transformer/, VAE, text encoders, scheduler)"
        )
    if config.model.config:
        raise ConfigError(
            f"model.config: the DiT {kind!r} starts from the transformer in model.path (its transformer/config.json); "
            f"remove model.config"
        )
    for tower in ("vision", "audio"):
        if getattr(config.model, f"freeze_{tower}"):
            raise ConfigError(f"model.freeze_{tower}: {kind!r} has no {tower} tower (its condition model is frozen)")
    if config.data.buckets is None:
        raise ConfigError(
            "data.buckets: required for DiTs: [[frames, height, width], ...] (video models) or [[height, width], ...]"
        )
    from runtime.data.dit.buckets import check_bucket_limits

    try:
        check_bucket_limits(config.data.buckets)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    prompts = config.validation.prompts  # runtime/train/samples.py generates each one
    if prompts is not None and (not prompts or not all(isinstance(p, str) and p.strip() for p in prompts)):
        raise ConfigError(f"validation.prompts: expected a list of non-empty prompts (or null), found {prompts!r:.80}")
    if config.parallel.ep != 1:
        raise ConfigError(f"parallel.ep: the DiT {kind!r} has no experts; remove parallel.ep")
    ema = config.dit.ema_decay
    if ema is not None and not 0.0 < ema < 1.0:
        raise ConfigError(f"dit.ema_decay: expected a number in (0, 1) (e.g. 0.999), found {ema}")
    if config.eval != EvalConfig():  # runtime/train/evaluate.py: text, VLM and omni models only
        raise ConfigError(
            f"eval: an eval-loss set is for text, VLM and omni models; for the DiT {kind!r} use validation "
            f"(sample images/videos from the current weights)"
        )


def _check_not_dit(config: RunConfig) -> None:
    """Keys that only DiTs read are errors elsewhere (a silently ignored key is a run that is not what was asked)."""
    kind = config.model.type
    for key, default in (("buckets", None), ("batch_size", 1), ("frame_stride", 1), ("cache", None)):
        if getattr(config.data, key) != default:
            raise ConfigError(f"data.{key}: only diffusion transformers read it; {kind!r} is not one")
    if config.dit != DiTConfig():
        raise ConfigError(f"dit: only diffusion transformers read this section; {kind!r} is not one")
    if config.validation != ValidationConfig():
        raise ConfigError(
            f"validation: sample generation is for diffusion transformers; {kind!r} is not one (an eval loss: eval)"
        )
    for key in ("every_steps", "max_batches"):  # without a file they would be silently ignored
        if config.eval.path is None and getattr(config.eval, key) != getattr(EvalConfig(), key):
            raise ConfigError(f"eval.{key}: set eval.path (the held-out file) or remove eval.{key}")
