"""`torchrun --nproc-per-node N -m runtime.train.prepare run.yaml`: compute the DiT conditions of every sample that
``data.cache`` lacks (VAE latents + text/image embeddings, spread over the ranks) and exit; the training run then
reads them without loading the VAE or the text encoders. Training fills the cache the same way on first use; this
step lets it happen on other machines (e.g. many small GPUs) or ahead of time. Exit 2 on user errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from runtime.train.config import ConfigError, load_config, locate_error


def prepare(config_path: str) -> int:
    """Fill the cache; the number of samples computed. Collective."""
    from runtime.train.data import is_dit
    from runtime.train.dit import check_transformer, quiet_loading, setup_conditions
    from runtime.train.dit_data import build_dataset, media_rules
    from runtime.train.loop import setup_parallel, train_device
    from runtime.train.validate import check_inputs

    config = load_config(config_path)
    if not is_dit(config):
        raise ConfigError(f"model.type: {config.model.type!r} is not a diffusion transformer; nothing to prepare")
    if not config.data.cache:
        raise ConfigError("data.cache: set it to the directory the conditions are cached in")
    state = setup_parallel(config)
    inputs = check_inputs(config, state)
    quiet_loading()
    check_transformer(config, state.sp_size)
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import lookup_dit

    rules = media_rules(condition_model_class(lookup_dit(config.model.type).data["condition_model_type"]))
    dataset = build_dataset(config, inputs.dit_samples, rules, state)
    _, conditions = setup_conditions(config, state, dataset, train_device(state))
    if state.rank == 0:
        print(f"conditions of {len(dataset)} samples are in {config.data.cache}", flush=True)
    return len(conditions.keys)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m runtime.train.prepare <config.yaml>", file=sys.stderr)
        return 2
    try:
        prepare(argv[0])
    except ConfigError as exc:
        message = str(exc)
        print(
            f"error: {message if message.startswith(argv[0]) else locate_error(message, Path(argv[0]))}",
            file=sys.stderr,
        )
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
