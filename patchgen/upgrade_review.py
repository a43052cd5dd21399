"""The review directory of `patchgen upgrade`: `upgrade-review/<release>/`, swapped in whole, never generated/.

Apart from the analysis (`patchgen.upgrade`) because it is the one place an upgrade writes when it does not apply:
the report, each new file built from the patches that apply, and its upstream diff.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from patchgen.config import ProjectConfig

if TYPE_CHECKING:
    from patchgen.upgrade import Upgrade

REVIEW_DIR = "upgrade-review"


def review_files(upgrade: Upgrade, report: str) -> dict[str, str]:
    """What the review directory holds: REPORT.md and each new generated file with its upstream diff."""
    files = {"REPORT.md": report}
    for model in upgrade.models:
        for one in model.generated.files if model.generated is not None else ():
            files[one.relpath] = one.text
            files[one.diff_relpath] = one.diff
    return files


def write_review(config: ProjectConfig, upgrade: Upgrade, report: str, extra: dict[str, str] | None = None) -> Path:
    """Replace `upgrade-review/<name>/` as a whole: a temp dir beside it is filled, then renamed into place.
    `extra`: more files by relative path (`specs.diff` of `--migrate`)."""
    final = config.root / REVIEW_DIR / upgrade.name
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{upgrade.name}."))
    try:
        for relpath, text in sorted({**review_files(upgrade, report), **(extra or {})}.items()):
            path = staging / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", newline="")
        if final.exists():
            old = final.with_name(f".{upgrade.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
