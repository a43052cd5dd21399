"""A rank that fails with the exit code given (``python -m tests.train.rank_exit CODE``): rank 1 exits with CODE at
once, the others wait to be stopped by the launcher. Started by ``tests/train/test_cli.py`` through the real
launcher, to see how a failed rank is reported."""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        sys.exit(int(sys.argv[1]))
    time.sleep(120)
