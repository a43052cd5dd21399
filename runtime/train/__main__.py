"""Train a generated model (text, vision-language, omni, diffusion transformer) with FSDP2, Ulysses SP and EP:
exact resume, metrics, checkpoints and export. docs/training.md explains every key and what is checked when."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from runtime.cli import Invocation, run_command
from runtime.train.config import ConfigError, RunConfig, load_config, locate_errors
from runtime.train.overrides import Override

COMMAND = "runtime.train"


def load(path: str, overrides: Sequence[Override]) -> RunConfig:
    return load_config(path, overrides)


def run(config: RunConfig, invocation: Invocation) -> None:
    import torch.distributed as dist

    from runtime.train.loop import train

    try:
        train(config)
    except ConfigError as exc:  # found while setting up (data, checkpoints, export, layout): named by its key
        raise locate_errors(exc, Path(invocation.config), invocation.overrides) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return run_command(
        argv,
        command=COMMAND,
        about=__doc__,
        references=[("run configuration", "runtime.train.config")],
        load=load,
        run=run,
    )


if __name__ == "__main__":
    sys.exit(main())
