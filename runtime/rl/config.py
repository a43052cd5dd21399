"""RL run configuration: YAML -> frozen dataclasses, validated by the config machinery (``runtime/config/``,
``locate_error``: one line naming the file, line and key; exit code 2).

A config names its algorithm at the top (``algorithm: flowgrpo``); the algorithm's own keys live in the section named
after it, whose dataclass and rules the algorithm module owns (``runtime/rl/algorithms/<name>.py``). The other
sections are shared by every algorithm; ``lora``, ``dit``, ``parallel``, ``optim``, ``checkpoint``, ``log`` and
``export`` are the sections every job shares (``runtime/config/common.py``), with the same keys and meaning.

Example (every key with its default unless marked required)::

    algorithm: flowgrpo          # required: flowgrpo, grpo_guard, flowdppo, mixgrpo, dancegrpo, diffusionnft, dpo,
                                 # diffusionopd (docs/flowgrpo.md)
    model:
      type: wan                  # a generated DiT (wan, flux, qwenimage, sd3, hunyuanvideo), or instead:
      architecture: null         # a non-diffusers model named explicitly (BagelMoT: no model_index.json tells it)
      adapter: {}                # its adapter's options (BagelMoT: text_guidance_scale, image_guidance_scale,
                                 # cfg_interval, cfg_renorm_min, cfg_renorm_type, timestep_shift)
      path: pipelines/wan        # required: a diffusers pipeline directory (the policy starts from transformer/),
                                 # or the non-diffusers checkpoint directory (BagelMoT: config.json, ema.safetensors,
                                 # tokenizer with BAGEL's special tokens, vae/)
      seed: 0                    # LoRA init and every sampling seed derive from it
      attn_implementation: sdpa  # or a diffusers attention backend
    lora: {rank: null, alpha: null, target_modules: null}  # rank null: full fine-tuning; target_modules null:
                                 # [to_q, to_k, to_v, to_out.0]
    dit:                         # the trainer's DiT section
      ema_decay: null            # e.g. 0.999: an EMA of the trained weights (checkpointed; the export uses it)
      condition: {}              # condition-model options, e.g. Flux's guidance embedding {guidance_scale: 3.5}
    reference: lora_disabled     # KL reference (flowgrpo.kl_coef > 0; dpo always): lora_disabled (the policy with its
                                 # LoRA turned off: no memory) | frozen_copy (a frozen copy of the starting weights)
    data:
      prompts: prompts.txt       # required: .txt (one prompt a line) or .jsonl ({"prompt": "..."} a line)
      pairs: null                # dpo only, instead of prompts: a JSONL of {"prompt", "chosen", "rejected"}
      prompts_per_step: 2        # prompts per data-parallel replica per iteration (each sampled group_size times)
      negative_prompt: ""        # the negative branch of true CFG
      seed: 0                    # the prompt order (a seeded permutation per epoch)
    sampling:
      height: 512                # required: pixels (multiples of the model's pixel multiple), at most 16384
      width: 512                 # required, at most 16384; frames x height x width at most 2**30
      frames: null               # video models: required (e.g. 81), at most 1024; image models: null
      num_inference_steps: 10
      true_cfg_scale: 1.0        # > 1: true classifier-free guidance with data.negative_prompt (Wan, Qwen-Image)
      true_cfg_scale_2: null     # two experts (Wan2.2 A14B): the scale on transformer_2's (low-noise) steps,
                                 # WanPipeline's guidance_scale_2; null: true_cfg_scale
      batch_size: null           # samples per rollout forward and per VAE decode; null: all of the replica's at once
    rewards:                     # required: one or more, combined as sum(weight * reward) (runtime/rl/rewards)
      - {name: aesthetic, callable: "my_pkg.rewards:score", weight: 1.0}
    reward_ranks: null           # null: every rank scores its own samples; [0, 1]: only these global ranks load the
                                 # reward models and score the whole batch in chunks (samples sent there)
    async_reward: false          # true: score each rollout chunk (sampling.batch_size) in the background while the
                                 # next chunk rolls out (verl-omni's async reward; the same rewards, bitwise)
    rollout_correction: {rollout_is: null, rollout_is_threshold: 2.0, rollout_rs: null, rollout_rs_threshold: null,
                         weighted_terms: all}
                                 # TIS and rejection sampling of an off-policy rollout: runtime/rl/correction_config.py
    parallel: {sp: 1, dp_replicate: 1, dp_shard: null, activation_checkpointing: false, overlap: false}
                                 # ulysses: u, ring: r (sp = u x r), as in the trainer's run config
    optim: {lr: 3.0e-4, weight_decay: 0.0, betas: [0.9, 0.95], eps: 1.0e-8, max_grad_norm: 1.0, warmup_steps: 0,
            min_lr_ratio: 0.1}
    train: {steps: 100, nonfinite: stop, mixed_precision: auto,  # steps: RL iterations (rollout, reward, update)
           self_check: true}  # before the first iteration: the policy's layout proven on a shrunk copy; off only
                              # as {enabled: false, reason: "..."} (recorded as "layout unproven")
    checkpoint: {dir: null, interval: 0, resume: auto, save_total_limit: 2, schedule_change: refuse}
    log: {dir: runs/latest, interval: 1, report_to: [], project: patchgen, run_name: null, progress: true}
    export: {dir: null, overwrite: false, fuse_lora: false}  # a pipeline directory, or the LoRA file
                                                             # load_lora_weights reads
    flowgrpo: {...}              # the algorithm's section: runtime/rl/algorithms/flowgrpo.py
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from runtime.config.common import (
    MIXED_PRECISION,
    NONFINITE,
    SHARED_RULES,
    CheckpointConfig,
    DiTConfig,
    ExportConfig,
    LogConfig,
    LoraConfig,
    OptimConfig,
    ParallelConfig,
    SelfCheckConfig,
)
from runtime.config.errors import ConfigError, ConfigErrors
from runtime.config.overrides import Override
from runtime.config.sections import KeyRules, collect_section, unknown_key_message
from runtime.config.yaml_file import load_config, locate_error
from runtime.rl.correction_config import RolloutCorrectionConfig, correction_problems
from runtime.rl.reward_entries import reward_entry_problems
from runtime.train.tracking.requirements import report_to_errors

if TYPE_CHECKING:
    from runtime.rl.algorithms.base import Algorithm

__all__ = [
    "ALGORITHMS",
    "RLConfig",
    "algorithm",
    "algorithm_module",
    "load_rl_config",
    "locate_rl_error",
    "parse_rl_config",
]

# algorithm name -> the module that owns its config section, rollout-window choice and per-step objective
ALGORITHMS = {
    "flowgrpo": "runtime.rl.algorithms.flowgrpo",
    "grpo_guard": "runtime.rl.algorithms.grpo_guard",
    "flowdppo": "runtime.rl.algorithms.flowdppo",
    "mixgrpo": "runtime.rl.algorithms.mixgrpo",
    "dancegrpo": "runtime.rl.algorithms.dancegrpo",
    "diffusionnft": "runtime.rl.algorithms.diffusionnft",
    "dpo": "runtime.rl.algorithms.dpo",
    "diffusionopd": "runtime.rl.algorithms.diffusionopd",
}
REFERENCES = ("lora_disabled", "frozen_copy")
MAX_REWARDS = 16  # a rewards list longer than this is not a reward mix


@dataclass(frozen=True)
class RLModelConfig:
    path: str
    type: str | None = None  # a generated DiT
    architecture: str | None = None  # a non-diffusers model's registered architecture (BagelMoT)
    adapter: dict = field(default_factory=dict)  # its adapter's options (BAGEL: guidance, timestep_shift)
    seed: int = 0
    attn_implementation: str = "sdpa"


@dataclass(frozen=True)
class PromptDataConfig:
    prompts: str | None = None  # required, except for offline algorithms (dpo), which read data.pairs instead
    pairs: str | None = None  # dpo's preference pairs (runtime/rl/pairs.py)
    prompts_per_step: int = 2
    negative_prompt: str = ""
    seed: int = 0


@dataclass(frozen=True)
class SamplingConfig:
    height: int
    width: int
    frames: int | None = None
    num_inference_steps: int = 10
    true_cfg_scale: float = 1.0
    true_cfg_scale_2: float | None = None  # WanPipeline's guidance_scale_2: transformer_2's steps (two experts)
    batch_size: int | None = None


@dataclass(frozen=True)
class RLTrainConfig:
    steps: int = 100
    nonfinite: str = "stop"
    mixed_precision: str = "auto"  # the trainer's train.mixed_precision: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    # before the first iteration: a shrunk copy of the policy's transformer under this layout against one process and
    # against upstream, as the trainer's train.self_check (runtime/train/self_check.py); off only with a reason
    self_check: SelfCheckConfig = field(default_factory=SelfCheckConfig)


@dataclass(frozen=True)
class RLConfig:
    algorithm: str
    model: RLModelConfig
    data: PromptDataConfig
    sampling: SamplingConfig
    rewards: list = field(default_factory=list)  # required, except for offline algorithms (dpo)
    reference: str = "lora_disabled"
    reward_ranks: list | None = None
    async_reward: bool = False  # score each rollout chunk while the next rolls out (loop.py, scoring.py)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    algo: Any = None  # the algorithm's section (its own dataclass), filled from the section named after it


RL_RULES = SHARED_RULES.merged(
    KeyRules(
        positive=frozenset(
            {
                "train.steps",
                "data.prompts_per_step",
                "sampling.height",
                "sampling.width",
                "sampling.frames",
                "sampling.num_inference_steps",
                "sampling.true_cfg_scale",
                "sampling.batch_size",
            }
        ),
        non_negative=frozenset({"data.seed", "model.seed"}),
        choices={"reference": REFERENCES, "train.nonfinite": NONFINITE, "train.mixed_precision": MIXED_PRECISION},
    )
)
_SHARED_KEYS = tuple(f.name for f in dataclasses.fields(RLConfig) if f.name != "algo")


def algorithm_module(name: str) -> Any:
    """The module of algorithm ``name`` (its docstring is the config reference ``--help`` prints)."""
    return importlib.import_module(ALGORITHMS[name])


def algorithm(name: str) -> Algorithm:
    """Algorithm ``name`` as the loop calls it (``runtime/rl/algorithms/base.py``: the contract)."""
    return algorithm_module(name).ALGORITHM


def parse_rl_config(raw: Any) -> RLConfig:
    """The RL config of the loaded YAML ``raw``; every error found in one ``ConfigError`` (``messages``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping, found {type(raw).__name__}")
    raw = dict(raw)
    name = raw.get("algorithm")
    if name is None:
        raise ConfigError(f"algorithm: required key missing; expected one of {', '.join(ALGORITHMS)}")
    if not isinstance(name, str) or name not in ALGORITHMS:
        close = difflib.get_close_matches(str(name), list(ALGORITHMS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"algorithm: unknown algorithm {name!r}{hint}; expected one of {', '.join(ALGORITHMS)}")
    algo = algorithm(name)
    section = raw.pop(name, {})
    errors = ConfigErrors()
    unknown = sorted(set(raw) - set(_SHARED_KEYS), key=str)
    errors.add(*(unknown_key_message("", key, (*_SHARED_KEYS, name), RL_RULES.renamed) for key in unknown))
    known = {key: value for key, value in raw.items() if key in _SHARED_KEYS}
    config = collect_section(RLConfig, known, "", RL_RULES, errors)
    config = dataclasses.replace(config, algo=collect_section(algo.Settings, section, name, algo.rules, errors))
    errors.run(lambda: _check_shared(config))
    errors.run(lambda: algo.check(config))
    errors.raise_if_any()
    return config


def _check_shared(config: RLConfig) -> None:
    """What no type check says: the reward list's shape, LoRA-only settings, the layout's expert axis. Every
    problem found in one ``ConfigError``."""
    errors = ConfigErrors()
    rewards = config.rewards or []
    online = algorithm(config.algorithm).data == "prompts"  # dpo checks its pairs itself
    if online and config.data is not None and config.data.pairs is not None:
        errors.add(f"data.pairs: preference pairs are dpo's data; {config.algorithm} samples data.prompts")
    elif online and config.data is not None and config.data.prompts is None:
        errors.add("data.prompts: required key missing")
    if online and not rewards:
        errors.add("rewards: name at least one reward (a list of {callable: ...}, {http: ...}, ...)")
    elif len(rewards) > MAX_REWARDS:
        errors.add(f"rewards: {len(rewards)} rewards; at most {MAX_REWARDS}")
    for index, item in enumerate(rewards[:MAX_REWARDS]):
        if not isinstance(item, dict):
            errors.add(f"rewards[{index}]: expected a mapping such as {{callable: module:function}}")
        else:
            errors.add(*reward_entry_problems(index, item))
    ranks = config.reward_ranks
    if ranks is not None and (
        not ranks
        or len(set(ranks)) != len(ranks)
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        errors.add(f"reward_ranks: expected null or a list of distinct global ranks (e.g. [0]), found {ranks!r}")
    algo = algorithm(config.algorithm)
    errors.add(*correction_problems(config.rollout_correction, config.algorithm, algo.trains_on))
    if config.async_reward and not online:
        errors.add(f"async_reward: {config.algorithm} scores no rollout (offline pairs); remove it")
    betas = config.optim.betas
    if len(betas) != 2 or not all(
        isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
    ):
        errors.add(f"optim.betas: expected two numbers in [0, 1), found {betas!r}")
    model = config.model
    if (model.type is None) == (model.architecture is None):
        errors.add(
            "model: name either model.type (a generated DiT) or model.architecture (a non-diffusers model), not "
            f"{'both' if model.type else 'neither'}"
        )
    if model.architecture is not None:
        for key, value, default in (
            ("parallel.sp", config.parallel.sp, 1),
            ("dit.condition", config.dit.condition, {}),
            ("model.attn_implementation", model.attn_implementation, "sdpa"),
        ):
            if value != default:
                errors.add(f"{key}: not for the non-diffusers {model.architecture!r}; remove {key}")
    elif model.adapter:
        errors.add("model.adapter: only for model.architecture (a DiT's options go in dit.condition)")
    if config.parallel.ep != 1:
        errors.add(f"parallel.ep: the model {model.type or model.architecture!r} has no experts; remove it")
    ema = config.dit.ema_decay
    if ema is not None and not 0.0 < ema < 1.0:
        errors.add(f"dit.ema_decay: expected a number in (0, 1) (e.g. 0.999), found {ema}")
    if config.export.fuse_lora and config.lora.rank is None:
        errors.add("export.fuse_lora: only for LoRA runs (set lora.rank)")
    if config.checkpoint.interval and not config.checkpoint.dir:
        errors.add("checkpoint.interval: set checkpoint.dir to say where checkpoints go")
    if config.sampling.true_cfg_scale < 1:
        errors.add(f"sampling.true_cfg_scale: expected >= 1 (1: off), found {config.sampling.true_cfg_scale}")
    scale_2 = config.sampling.true_cfg_scale_2
    if scale_2 is not None and (scale_2 < 1 or config.sampling.true_cfg_scale <= 1):
        errors.add(
            f"sampling.true_cfg_scale_2: expected >= 1 with sampling.true_cfg_scale > 1 (WanPipeline guides both "
            f"experts only when guidance_scale > 1), found {scale_2} with true_cfg_scale "
            f"{config.sampling.true_cfg_scale}"
        )
    errors.add(*sampling_size_errors(config.sampling))
    errors.add(*report_to_errors(config.log.report_to))  # known trackers, installed (find_spec: nothing imported)
    errors.raise_if_any()


def sampling_size_errors(sampling: SamplingConfig) -> list[str]:
    """The sampled size's limits, the DiT trainer's bucket limits (``runtime/data/dit/buckets.py``): beyond them a run
    exhausts the machine (or overflows a size computation) instead of sampling. One message per key."""
    from runtime.data.dit.buckets import MAX_BUCKET_FRAMES, MAX_BUCKET_PIXELS, MAX_BUCKET_SIDE

    errors = [
        f"sampling.{key}: {value}: more than {MAX_BUCKET_SIDE} pixels (the limit)"
        for key, value in (("height", sampling.height), ("width", sampling.width))
        if value > MAX_BUCKET_SIDE
    ]
    frames = sampling.frames or 1
    if frames > MAX_BUCKET_FRAMES:
        errors.append(f"sampling.frames: {frames}: more than {MAX_BUCKET_FRAMES} frames (the limit)")
    pixels = frames * sampling.height * sampling.width
    if not errors and pixels > MAX_BUCKET_PIXELS:
        errors.append(
            f"sampling: {frames} x {sampling.height} x {sampling.width} pixels per sample, more than "
            f"{MAX_BUCKET_PIXELS} (2**30, the limit)"
        )
    return errors


_LIST_ENTRY = re.compile(r"^([A-Za-z_]\w*)\[(\d+)\]")


def locate_rl_error(message: str, path: Path) -> str:
    """``locate_error`` (file and line of the key a message starts with), and for an entry of a top-level list
    (``rewards[1].http: ...``) the line of that entry."""
    match = _LIST_ENTRY.match(message)
    if match:
        try:
            node = yaml.compose(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            node = None
        if isinstance(node, yaml.MappingNode):
            value = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == match[1]), None)
            index = int(match[2])
            if isinstance(value, yaml.SequenceNode) and index < len(value.value):
                return f"{path}:{value.value[index].start_mark.line + 1}: {message}"
    return locate_error(message, path)


def load_rl_config(path: str | Path, overrides: Sequence[Override] = ()) -> RLConfig:
    """The RL config in ``path`` with the command-line ``overrides`` set; every error in one ``ConfigError``, each
    message naming the file and line (or the override) and the key."""
    return load_config(path, overrides, parse_rl_config, locate_rl_error)
