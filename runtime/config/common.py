"""The config sections every job shares (the trainer, the RL job, the planner's layout): the parallel layout, the
optimizer and its schedule, checkpoints, logging, export, LoRA and the DiT options, with their key rules
(``SHARED_RULES``) and the keys renamed to the names HF TrainingArguments / torchtitan users know."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.config.errors import ConfigError
from runtime.config.sections import KeyRules

__all__ = [
    "COMPILE_BACKENDS",
    "MIXED_PRECISION",
    "NONFINITE",
    "OPTIMIZERS",
    "REPORT_TO",
    "SCHEDULE_CHANGES",
    "SCHEDULERS",
    "SHARED_RULES",
    "CheckpointConfig",
    "DiTConfig",
    "ExportConfig",
    "LogConfig",
    "LoraConfig",
    "OptimConfig",
    "ParallelConfig",
    "SelfCheckConfig",
]

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd")  # HF TrainingArguments' `optim` names
# transformers.get_scheduler's names (SchedulerType) that need no more than warmup, the step count and min_lr_ratio
SCHEDULERS = ("cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "bf16", "fp32")  # a job's train.mixed_precision
NONFINITE = ("stop", "skip")  # a job's train.nonfinite
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # a job's train.compile_backend (torchtitan's compile.backend)
REPORT_TO = ("tensorboard", "wandb", "mlflow")
SCHEDULE_CHANGES = ("refuse", "continue", "replan")  # checkpoint.schedule_change


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
    name: str = "adamw_torch"  # HF TrainingArguments' `optim` values (OPTIMIZERS)
    lr_scheduler_type: str = "cosine_with_min_lr"  # transformers.get_scheduler's names (SCHEDULERS)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    interval: int = 0
    resume: str | None = "auto"  # "auto": newest intact checkpoint in dir, null: start fresh, or a path
    save_total_limit: int = 2  # checkpoints kept (HF TrainingArguments' name; torchtitan: keep_latest_k)
    # a resume whose schedule keys move a resumed step's learning rate: refuse | continue (the saved curve) | replan
    # (this config's schedule, as HF Trainer and torchtitan resume); runtime/train/schedule_keys.py
    schedule_change: str = "refuse"


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
class SelfCheckConfig:
    """``train.self_check``: ``true`` (the default) proves the job's layout on a shrunk copy of its model before it
    trains (``runtime/train/self_check.py``). Skipping the proof is never silent: ``{enabled: false, reason: "..."}``
    only, the reason printed at start and recorded in checkpoints and exports as "layout unproven"; a bare ``false``
    is refused (a forgotten switch would otherwise re-open every spec mistake the proof catches)."""

    enabled: bool = True
    reason: str | None = None

    def problems(self, key: str) -> list[str]:
        """This section's own rule (``collect_section`` runs it): off needs a reason."""
        if self.enabled or (self.reason or "").strip():
            return []
        return [
            f'{key}: false needs a reason: write `{key.rpartition(".")[2]}: {{enabled: false, reason: "why this run '
            'may train with its layout unproven"}` (printed at start, recorded in checkpoints and exports)'
        ]

    @property
    def unproven(self) -> str | None:
        """What a run that skipped the proof records in its checkpoints and exports; None when it ran."""
        return None if self.enabled else f"layout unproven (self_check off: {self.reason})"


@dataclass(frozen=True)
class DiTConfig:
    ema_decay: float | None = None
    condition: dict = field(default_factory=dict)  # condition-model options (noise-level recipe, guidance_scale)


SHARED_RULES = KeyRules(
    positive=frozenset(
        {
            "parallel.sp",
            "parallel.ulysses",
            "parallel.ring",
            "parallel.ep",
            "parallel.dp_replicate",
            "parallel.dp_shard",
            "log.interval",
            "log.peak_tflops",
            "checkpoint.save_total_limit",
            "lora.rank",
            "lora.alpha",
        }
    ),
    non_negative=frozenset(
        {
            "optim.lr",
            "optim.weight_decay",
            "optim.max_grad_norm",
            "optim.eps",
            "optim.warmup_steps",
            "checkpoint.interval",
        }
    ),
    unit_interval=frozenset({"optim.min_lr_ratio", "lora.dropout"}),
    choices={
        "optim.name": OPTIMIZERS,
        "optim.lr_scheduler_type": SCHEDULERS,
        "checkpoint.schedule_change": SCHEDULE_CHANGES,
    },
    # keys renamed to the names HF TrainingArguments / torchtitan users know: an old name is refused with the new one
    renamed={
        "optim.grad_clip": "optim.max_grad_norm",
        "checkpoint.keep": "checkpoint.save_total_limit",
        "log.tensorboard": "log.report_to (a list: [tensorboard])",
        "dit.lora": "lora (a top-level section, for every model family)",
    },
)
