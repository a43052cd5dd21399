"""RL fine-tuning of a diffusion model (FlowGRPO).

Exit code 2 with one line naming the file, line and key for a bad config or input, and for a run stopped by a guard
(non-finite values, the rollout-vs-training log-prob gap alarm with `on_logprob_gap: stop`, a policy that did not
change, a reward that failed). `--help` prints the config reference without importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.cli import Invocation, run_command
from runtime.train.overrides import Override

COMMAND = "runtime.rl"


def references() -> list[tuple[str, str]]:
    from runtime.rl.config import ALGORITHMS

    return [("RL configuration", "runtime.rl.config")] + [
        (f"algorithm {name}", module) for name, module in ALGORITHMS.items()
    ]


def load(path: str, overrides: Sequence[Override]) -> Any:
    from runtime.rl.config import load_rl_config

    return load_rl_config(path, overrides)


def run(config: Any, invocation: Invocation) -> None:
    import torch.distributed as dist

    from runtime.rl.config import locate_rl_error
    from runtime.rl.loop import run_rl
    from runtime.train.config import ConfigError, locate_errors

    try:
        run_rl(config)
    except ConfigError as exc:  # found while setting up or stopped by a guard: named by its key
        raise locate_errors(exc, Path(invocation.config), invocation.overrides, locate_rl_error) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return run_command(argv, command=COMMAND, about=__doc__, references=references(), load=load, run=run)


if __name__ == "__main__":
    sys.exit(main())
