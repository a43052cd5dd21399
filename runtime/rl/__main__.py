"""RL fine-tuning of a diffusion model: online FlowGRPO, GRPO-Guard, MixGRPO, DanceGRPO, DiffusionNFT, FlowDPPO and
DiffusionOPD (on-policy distillation), offline DPO (``algorithm:``; docs/flowgrpo.md).

Exit code 2 with one line naming the file, line and key for a bad config or input, and for a run stopped by a guard
(non-finite values, the rollout-vs-training log-prob gap alarm with `on_logprob_gap: stop`, a policy that did not
change, a reward that failed). `--help` prints the config reference without importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.cli import run_command
from runtime.config.overrides import Override

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig

COMMAND = "runtime.rl"


def references() -> list[tuple[str, str]]:
    from runtime.rl.config import ALGORITHMS

    return [("RL configuration", "runtime.rl.config")] + [
        (f"algorithm {name}", module) for name, module in ALGORITHMS.items()
    ]


def load(path: str, overrides: Sequence[Override]) -> RLConfig:
    from runtime.rl.config import load_rl_config

    return load_rl_config(path, overrides)


def run(config: RLConfig) -> None:
    from runtime.rl.loop import run_rl

    run_rl(config)


def locate(message: str, path: Path) -> str:
    from runtime.rl.config import locate_rl_error

    return locate_rl_error(message, path)


def main(argv: list[str] | None = None) -> int:
    return run_command(
        argv, command=COMMAND, about=__doc__, references=references(), load=load, run=run, locate=locate
    )


if __name__ == "__main__":
    sys.exit(main())
