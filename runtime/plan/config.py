"""A plan file: the model (type + the published config's numbers), the workload of one micro-batch, the layout.

YAML, read and checked with the run config's own machinery (``runtime/config/``: size, depth, unknown keys,
types and ranges; ``runtime.plan.model_check``: ``model.type`` and ``model.config`` as the trainer checks them), every
error of a file at once, each a one-line error naming the file, the key's line and the key. No torch is imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config.common import ParallelConfig
from runtime.config.errors import ConfigError, ConfigErrors
from runtime.config.overrides import Override, apply_overrides
from runtime.config.sections import KeyRules, collect_section
from runtime.config.yaml_file import locate_errors, read_config_file
from runtime.plan.model_check import model_problems

__all__ = ["ConfigError", "PlanConfig", "PlanModel", "Workload", "read_plan"]


@dataclass(frozen=True)
class PlanModel:
    type: str  # a registered model_type (runtime/models/registry.py) or a DiT spec's (runtime/diffusion/registry.py)
    name: str = ""  # what the tables call it, e.g. "Qwen3-8B"
    config: dict = field(default_factory=dict)  # the published config.json's numbers (a DiT: its transformer's)
    # a DiT's VAE and pipeline, named as diffusers' pipelines name them (null: the family's usual VAE,
    # runtime/plan/dit_inputs.py); Wan2.2 TI2V: 16 spatial and expand_timesteps (one timestep per latent token)
    vae_scale_factor_spatial: int | None = None
    vae_scale_factor_temporal: int | None = None
    expand_timesteps: bool = False


@dataclass(frozen=True)
class Workload:
    """One micro-batch per data-parallel replica. Text models: ``tokens`` (one packed row); DiTs: one clip or image
    of ``frames`` x ``height`` x ``width`` pixels with ``text_tokens`` of conditioning."""

    tokens: int | None = None
    loss_chunk_size: int | None = None  # text models: the chunked loss's chunk (null: full logits)
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    text_tokens: int = 512


@dataclass(frozen=True)
class PlanConfig:
    model: PlanModel
    workload: Workload
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


RULES = KeyRules(
    positive=frozenset(
        {
            "workload.tokens",
            "workload.loss_chunk_size",
            "workload.frames",
            "workload.height",
            "workload.width",
            "workload.text_tokens",
            "model.vae_scale_factor_spatial",
            "model.vae_scale_factor_temporal",
            "parallel.sp",
            "parallel.ep",
            "parallel.dp_replicate",
            "parallel.dp_shard",
        }
    )
)
SECTIONS = {"model": PlanModel, "workload": Workload, "parallel": ParallelConfig}


def read_plan(path: str | Path, overrides: Sequence[Override] = ()) -> PlanConfig:
    """The checked plan file with the command-line ``overrides`` set (``--parallel.sp=2``, as ``runtime.train``
    takes them); a ``ConfigError`` otherwise, with every error of the file (``messages``), each one line naming the
    file, the key's line and the key, or the override that set it."""
    path = Path(path)
    raw, problems = apply_overrides(read_config_file(path), overrides)
    if problems:
        raise ConfigError(*problems)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(SECTIONS)}")
    errors = ConfigErrors()
    for name in sorted(set(raw) - set(SECTIONS), key=str):
        errors.add(f"{name}: unknown section; expected one of {', '.join(SECTIONS)}")
    errors.add(*(f"{name}: required section missing" for name in ("model", "workload") if name not in raw))
    sections = {
        name: collect_section(cls, raw[name], name, RULES, errors) for name, cls in SECTIONS.items() if name in raw
    }
    if "model" in sections:
        model = sections["model"]
        errors.run(lambda: errors.add(*model_problems(model.type, model.config or {})))
    if errors.messages:  # each message with the file and its key's line, in the order of the lines
        raise locate_errors(ConfigError(*errors.messages), path, overrides)
    return PlanConfig(**sections)
