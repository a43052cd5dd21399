"""The trainer's run config: its sections (the shared ones from ``runtime/config/common.py``), read and checked by
the config machinery (``runtime/config/``) and the trainer's checks across sections (``config_checks.py``).

Example (every key shown with its default unless marked required)::

    model:
      type: qwen3              # required: HF model_type with a generated class (runtime/models/registry.py)
      path: null               # local HF checkpoint; null = random init from `config`
      config: {}               # overrides for random init (AutoConfig.for_model(type, **config))
      seed: 0
      attn_implementation: sdpa  # eager | sdpa | flex_attention | flash_attention_2/3/4 (where flash-attn is
                                 # installed); DiTs: sdpa (the processors' own) or a diffusers attention backend
      experts_implementation: patchgen_grouped  # MoE: eager | patchgen_grouped | patchgen_triton | patchgen_eager
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
            compile_backend: inductor,  # inductor | aot_eager | eager (torchtitan's compile.backend)
            mixed_precision: auto,  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32; bf16: bf16 parameters and
                                    # compute, fp32 gradient reduction, fp32 master weights and optimizer state
            self_check: true}  # before step 1, a shrunk copy of the model under this run's layout against one
                               # process and against upstream (runtime/train/self_check.py); skipping it needs
                               # a reason: {enabled: false, reason: "..."} (checkpoints/exports: "layout unproven")
    checkpoint: {dir: null, interval: 0, resume: auto, save_total_limit: 2, schedule_change: refuse}
                               # schedule_change: refuse | continue | replan (a resume that changes the schedule)
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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.config.common import COMPILE_BACKENDS, MIXED_PRECISION, NONFINITE, SHARED_RULES
from runtime.config.errors import ConfigError, ConfigErrors
from runtime.config.overrides import Override
from runtime.config.sections import KeyRules, collect_section
from runtime.config.yaml_file import load_config
from runtime.train import config_checks
from runtime.train.config_sections import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    ValidationConfig,
)

__all__ = [
    "TRAIN_RULES",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "ValidationConfig",
    "load_run_config",
    "parse_config",
]


TRAIN_RULES = SHARED_RULES.merged(
    KeyRules(
        positive=frozenset(
            {
                "data.token_budget",
                "data.batch_size",
                "data.frame_stride",
                "train.steps",
                "train.micro_batches",
                "train.loss_chunk_size",
                "eval.max_batches",
                "validation.num_inference_steps",
                "validation.guidance_scale",
            }
        ),
        non_negative=frozenset(
            {"model.seed", "data.seed", "eval.every_steps", "validation.every_steps", "validation.seed"}
        ),
        choices={
            "train.nonfinite": NONFINITE,
            "train.compile_backend": COMPILE_BACKENDS,
            "train.mixed_precision": MIXED_PRECISION,
            "model.experts_implementation": config_checks.EXPERTS_IMPLEMENTATIONS,
        },
    )
)


def parse_config(raw: Any) -> RunConfig:
    """The run config of the loaded YAML ``raw``; every error found in one ``ConfigError`` (``messages``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, found {type(raw).__name__}")
    errors = ConfigErrors()
    config = collect_section(RunConfig, raw, "", TRAIN_RULES, errors)
    for check in config_checks.CHECKS:
        errors.run(lambda check=check: check(config))
    errors.raise_if_any()
    return config


def load_run_config(path: str | Path, overrides: Sequence[Override] = ()) -> RunConfig:
    """The run config in the YAML file ``path`` with the command-line ``overrides`` set; every error in one
    ``ConfigError``, each message naming the file and line (or the override) and the key."""
    return load_config(path, overrides, parse_config)
