"""`torchrun --nproc-per-node N -m runtime.rl config.yaml`: RL fine-tuning of a diffusion model (FlowGRPO).

Exit code 2 with one line naming the file, line and key for a bad config or input, and for a run stopped by a guard
(non-finite values, the rollout-vs-training log-prob gap alarm with `on_logprob_gap: stop`, a policy that did not
change, a reward that failed). `--help` prints the config reference without importing torch.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

USAGE = "usage: torchrun --nproc-per-node N -m runtime.rl <config.yaml>   (or: python -m runtime.rl --help)"


def _docstring(module: str) -> str:
    """A module's docstring read from its source (nothing is imported: no torch for --help)."""
    origin = importlib.util.find_spec(module).origin
    return ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8"))) or ""


def help_text() -> str:
    from runtime.rl.config import ALGORITHMS

    parts = [USAGE, "", _docstring("runtime.rl.config")]
    for name, module in ALGORITHMS.items():
        parts += ["", f"== algorithm {name} ({module}) ==", _docstring(module)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):
        print(help_text())
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    from runtime.train.config import ConfigError

    try:
        from runtime.rl.config import load_rl_config, locate_rl_error

        config = load_rl_config(argv[0])  # its errors name the file and line already
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from runtime.rl.loop import run_rl

    try:
        run_rl(config)
    except ConfigError as exc:  # found while setting up or stopped by a guard: named by its key
        print(f"error: {locate_rl_error(str(exc), Path(argv[0]))}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
