"""The trainer's run-config sections as typed frozen dataclasses (what ``runtime.train.config`` parses YAML into;
the keys and their meaning are documented there). Their own module so that the cross-section checks
(``config_checks.py``) name ``RunConfig`` without importing the parser that runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.config.common import (
    CheckpointConfig,
    DiTConfig,
    ExportConfig,
    LogConfig,
    LoraConfig,
    OptimConfig,
    ParallelConfig,
    SelfCheckConfig,
)

__all__ = ["DataConfig", "EvalConfig", "ModelConfig", "RunConfig", "TrainConfig", "ValidationConfig"]


@dataclass(frozen=True)
class ModelConfig:
    type: str
    path: str | None = None
    config: dict = field(default_factory=dict)
    seed: int = 0
    attn_implementation: str = "sdpa"
    experts_implementation: str = "patchgen_grouped"  # MoE: eager, patchgen_grouped, patchgen_triton, patchgen_eager
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
class TrainConfig:
    steps: int = 100
    micro_batches: int = 1
    loss_chunk_size: int | None = None
    # a non-finite loss or gradient norm: "stop" the run (exit 2, naming the step and its samples) or "skip" the
    # optimizer step (counted in the metrics as `skipped_nonfinite`); never an update with a non-finite value
    nonfinite: str = "stop"
    compile: bool = False  # torch.compile each transformer block, as torchtitan (runtime/parallel/compile.py)
    # the compiler backend (torchtitan's compile.backend): inductor (generated kernels) | aot_eager (dynamo and
    # AOTAutograd's traced graphs run eagerly: isolates a compiler problem from a tracing one) | eager
    compile_backend: str = "inductor"
    # auto: bf16 parameters/compute with fp32 gradient reduction and fp32 master weights on GPU, fp32 on CPU;
    # bf16 / fp32: that, on any device (accelerate's --mixed_precision, torchtitan's mixed_precision_param)
    mixed_precision: str = "auto"
    # before step 1: one forward/backward of a shrunk copy of the model under the job's layout against one process,
    # and the generated class against upstream; a mismatch stops the run (runtime/train/self_check.py). Off only
    # with a reason: {enabled: false, reason: "..."} (the run is recorded as "layout unproven")
    self_check: SelfCheckConfig = field(default_factory=SelfCheckConfig)


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
