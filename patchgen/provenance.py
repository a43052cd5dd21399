"""The input hashes and the review diff: what `patchgen check` needs to prove an output current without generating
it (so its fast path imports neither libcst nor the rewriter)."""

from __future__ import annotations

import difflib
import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from patchgen.spec import Spec
    from patchgen.upstream import UpstreamFile

PACKAGE_DIR = Path(__file__).parent
# The front ends run generation (or propose spec edits, or test its output) but decide no byte of it. Every other
# module of the package can (spec parsing, upstream reading, file writing included), so all of them are hashed into
# every header: the list is derived, never maintained by hand (a test checks it covers every module generation
# imports).
FRONT_ENDS = (
    "cli.py",
    "draft/",  # a package: `patchgen draft` writes a spec, the usual generation then reads it
    "migrate.py",
    "migrate_rules/",  # a package: every module under it
    "report.py",
    "scratch_env.py",
    "spec_edits.py",
    "upgrade.py",
    "upgrade_review.py",
    "upgrade_status.py",
    "verify.py",
    "verify_edits.py",
)


def _engine_files() -> tuple[str, ...]:
    names = (path.relative_to(PACKAGE_DIR).as_posix() for path in PACKAGE_DIR.rglob("*.py"))
    return tuple(sorted(name for name in names if not any(_is_front_end(name, entry) for entry in FRONT_ENDS)))


def _is_front_end(name: str, entry: str) -> bool:
    return name.startswith(entry) if entry.endswith("/") else name == entry


ENGINE_FILES = _engine_files()


@functools.cache
def engine_sha256() -> str:
    """One hash of every engine module's bytes: a header input, so any engine change is drift until regenerated."""
    digest = hashlib.sha256()
    for name in ENGINE_FILES:
        digest.update(name.encode() + b"\0" + (PACKAGE_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def templates_sha256(spec: Spec) -> str:
    used = sorted({(p.template.name, p.template.sha256) for p in spec.patches})
    return hashlib.sha256("\n".join(f"{n} {s}" for n, s in used).encode()).hexdigest()


def unified_diff(upstream: UpstreamFile, text: str, relpath: str) -> str:
    """The review diff written beside each generated file: upstream -> generated."""
    lines = difflib.unified_diff(
        upstream.text.splitlines(keepends=True),
        text.splitlines(keepends=True),
        fromfile=f"a/{upstream.relpath} ({upstream.pin})",
        tofile=f"b/{relpath}",
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
