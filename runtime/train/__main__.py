"""Train a generated model (text, vision-language, omni, diffusion transformer) with FSDP2, Ulysses SP and EP:
exact resume, metrics, checkpoints and export. docs/training.md explains every key and what is checked when."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from runtime.cli import run_command
from runtime.config.overrides import Override
from runtime.train.config import RunConfig, load_run_config

COMMAND = "runtime.train"


def load(path: str, overrides: Sequence[Override]) -> RunConfig:
    return load_run_config(path, overrides)


def before_launch(config: RunConfig) -> None:
    from runtime.train.preflight import check_before_launch

    check_before_launch(config)


def run(config: RunConfig) -> None:
    from runtime.train.loop import train

    train(config)


def main(argv: list[str] | None = None) -> int:
    return run_command(
        argv,
        command=COMMAND,
        about=__doc__,
        references=[("run configuration", "runtime.train.config")],
        load=load,
        run=run,
        before_launch=before_launch,
    )


if __name__ == "__main__":
    sys.exit(main())
