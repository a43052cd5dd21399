"""Compute the DiT conditions of every sample that ``data.cache`` lacks (VAE latents + text/image embeddings, spread
over the ranks) and exit; the training run then reads them without loading the VAE or the text encoders. Training
fills the cache the same way on first use; this step lets it happen on other machines (e.g. many small GPUs) or ahead
of time. It reads the training run's own config (``data.cache`` set). Exit 2 on user errors.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from runtime.cli import run_command
from runtime.config.errors import ConfigError
from runtime.config.overrides import Override
from runtime.config.yaml_file import locate_errors
from runtime.train.config import RunConfig, load_run_config

COMMAND = "runtime.train.prepare"


def load(path: str, overrides: Sequence[Override] = ()) -> RunConfig:
    """The training config, which must name a DiT and a condition cache."""
    config = load_run_config(path, overrides)
    errors = []
    if not _is_dit(config):
        errors.append(f"model.type: {config.model.type!r} is not a diffusion transformer; nothing to prepare")
    if not config.data.cache:
        errors.append("data.cache: set it to the directory the conditions are cached in")
    if errors:
        raise locate_errors(ConfigError(*errors), Path(path), overrides)
    return config


def _is_dit(config: RunConfig) -> bool:
    from runtime.models.registry import REGISTRY

    entry = REGISTRY.get(config.model.type)
    return entry is not None and entry.family == "dit"


def prepare(config: RunConfig | str) -> int:
    """Fill the cache; the number of samples computed. Collective."""
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import lookup_dit
    from runtime.train.dit import check_transformer, quiet_loading, setup_conditions
    from runtime.train.dit_data import build_dataset, media_rules
    from runtime.train.loop import setup_parallel, train_device
    from runtime.train.preflight import check_inputs

    if isinstance(config, str):
        config = load(config)
    state = setup_parallel(config)
    inputs = check_inputs(config, state, exports=False)  # prepare fills the cache; it never exports
    quiet_loading()
    check_transformer(config, state.ulysses_size)
    rules = media_rules(condition_model_class(lookup_dit(config.model.type).data["condition_model_type"]))
    dataset = build_dataset(config, inputs.dit_samples, rules, state)
    _, conditions = setup_conditions(config, state, dataset, train_device(state))
    if state.rank == 0:
        print(f"conditions of {len(dataset)} samples are in {config.data.cache}", flush=True)
    return len(conditions.keys)


def before_launch(config: RunConfig) -> None:
    from runtime.train.preflight import check_before_launch

    check_before_launch(config, exports=False)  # prepare never exports


def main(argv: list[str] | None = None) -> int:
    references = [("run configuration", "runtime.train.config")]
    checks = before_launch
    return run_command(
        argv, command=COMMAND, about=__doc__, references=references, load=load, run=prepare, before_launch=checks
    )


if __name__ == "__main__":
    sys.exit(main())
