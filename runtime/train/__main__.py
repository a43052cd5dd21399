"""`torchrun --nproc-per-node N -m runtime.train config.yaml`: train a generated model. Exit 2 on config errors."""

from __future__ import annotations

import sys

import torch.distributed as dist

from runtime.train.config import ConfigError, load_config
from runtime.train.loop import train


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m runtime.train <config.yaml>", file=sys.stderr)
        return 2
    try:
        train(load_config(argv[0]))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
