"""Child process of test_kill: save step 1, then get stuck in the middle of saving step 2 until SIGKILLed.

Run as ``python -m tests.checkpoint.kill_child ROOT``. Writes ``ROOT/../expected.pt`` (what step 1 must restore)
and, once step 2's DCP files are written but before the save completes, ``ROOT/../ready`` for the parent.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from runtime.checkpoint import dcp as ckpt
from tests.checkpoint.common import mlp, mlp_step


def main(root: Path) -> None:
    torch.set_num_threads(1)
    model, optimizer, scheduler = mlp(seed=0)
    mlp_step(model, optimizer, scheduler, 0)
    expected = {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "rng": torch.get_rng_state(),
        "lr": scheduler.get_last_lr(),
    }
    ckpt.save_checkpoint(root, 1, model, optimizer, scheduler, extra={"step": 1})
    torch.save(expected, root.parent / "expected.pt")

    def hang(stage: str, path: Path) -> None:
        if stage == "dcp_saved":
            (root.parent / "ready").write_text(str(path))
            time.sleep(600)

    ckpt._fault_point = hang
    mlp_step(model, optimizer, scheduler, 1)
    ckpt.save_checkpoint(root, 2, model, optimizer, scheduler, extra={"step": 2})
    raise AssertionError("the save of step 2 should never return")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
