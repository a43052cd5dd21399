"""RL fine-tuning of a diffusion model: online FlowGRPO, GRPO-Guard, MixGRPO, DanceGRPO, DiffusionNFT, FlowDPPO and
DiffusionOPD (on-policy distillation), offline DPO (``algorithm:``; docs/flowgrpo.md).

Exit code 2 with one line naming the file, line and key for a bad config or input, and for a run stopped by a guard
(non-finite values, the rollout-vs-training log-prob gap alarm with `on_logprob_gap: stop`, a policy that did not
change, a reward that failed). With launcher options (``--nproc-per-node 2``) every check that needs no rank runs in
the launcher first, all its errors at once; a refusal the ranks find is printed once, by rank 0. An interrupt
(Ctrl-C, or a reward that raised KeyboardInterrupt) is one line and exit code 130. `--help` prints the config
reference without importing torch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.cli import is_rank_zero, print_errors, run_command, under_torchrun
from runtime.config.errors import ConfigError
from runtime.config.overrides import Override

if TYPE_CHECKING:
    from runtime.rl.config import RLConfig

COMMAND = "runtime.rl"
INTERRUPTED = 130  # the shell's 128 + SIGINT
QUIET_RANK_WAIT = 60.0  # seconds a rank other than 0 waits, silent, for torchrun to stop it after rank 0 refused


def references() -> list[tuple[str, str]]:
    from runtime.rl.config import ALGORITHMS

    return [("RL configuration", "runtime.rl.config")] + [
        (f"algorithm {name}", module) for name, module in ALGORITHMS.items()
    ]


def load(path: str, overrides: Sequence[Override]) -> RLConfig:
    from runtime.rl.config import load_rl_config

    return load_rl_config(path, overrides)


def before_launch(config: RLConfig) -> None:
    from runtime.rl.preflight import check_before_launch

    check_before_launch(config)


def run(config: RLConfig) -> None:
    """``run_rl``; a refusal every rank agreed on is said by rank 0 alone: another rank waits, silent, for torchrun
    to stop it once rank 0 has exited, then exits with code 2 itself."""
    from runtime.rl.loop import run_rl
    from runtime.rl.preflight import RefusedOnEveryRank

    try:
        run_rl(config)
    except RefusedOnEveryRank:
        if is_rank_zero() or not under_torchrun():
            raise
        time.sleep(QUIET_RANK_WAIT)
        raise SystemExit(2) from None


def locate(message: str, path: Path) -> str:
    from runtime.rl.config import locate_rl_error

    return locate_rl_error(message, path)


def main(argv: list[str] | None = None) -> int:
    try:
        return run_command(
            argv,
            command=COMMAND,
            about=__doc__,
            references=references(),
            load=load,
            run=run,
            locate=locate,
            before_launch=before_launch,
        )
    except KeyboardInterrupt as exc:  # the process groups are freed already (run_command's teardown)
        print_errors(ConfigError(f"interrupted{f' ({exc})' if str(exc) else ''}"))  # once per launch, as errors
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
