"""`torchrun --nproc-per-node N -m runtime.train config.yaml`: train a generated model. Exit 2 on config errors."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from runtime.train.config import ConfigError, load_config, locate_error
from runtime.train.loop import train


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m runtime.train <config.yaml>", file=sys.stderr)
        return 2
    try:
        config = load_config(argv[0])  # its errors name the file and line already
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        train(config)
    except ConfigError as exc:  # found while setting up (data, checkpoints, export, layout): named by its key
        print(f"error: {locate_error(str(exc), Path(argv[0]))}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
