"""The journal of an all-or-nothing write, and the proof recovery needs before it replays one.

A journal is data found on disk: anyone who can write into the project can plant one, and every patchgen command
replays what it finds. So `verify` accepts a journal only when the interrupted write itself could have left it:
- it names only what a journaled write may touch (`Confinement`): the files the current specs own inside the
  generated directory (output, review diff, model record, package `__init__.py` files), and pyproject.toml for a
  change of its pins (`upgrade --apply`); the directories it creates lie inside the generated directory;
- no path reaches its target through a symlink (every component below the project root is checked with lstat);
- the staging directory holds only regular files with the names patchgen gives them, and every staged file, backup
  and target is in a state the write could have left, by the sha256 the journal recorded for it.
Anything else is refused before a single file is touched; the journal is left for the user.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from patchgen.config import with_pins
from patchgen.errors import PatchgenError
from patchgen.provenance import file_sha256

TXN_DIR = ".patchgen-txn"
JOURNAL = "journal.json"
ROLLBACK = "rollback"
GITIGNORE_NAME = ".gitignore"
OWN_NAMES = (GITIGNORE_NAME, JOURNAL, JOURNAL + ".tmp", ROLLBACK)  # besides the staged files `<n>.new`, `<n>.old`
STAGED = re.compile(r"\d+\.(new|old)")
MAX_JOURNAL_BYTES = 1 << 20  # a journal lists a few hundred entries at most
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ENTRY_KEYS = {"target", "new", "old", "new_sha256", "old_sha256"}


class Refused(Exception):
    """Why a journal (or the staging directory) must not be replayed."""


@dataclass(frozen=True)
class Confinement:
    """The only files a journaled write, and so a journal, may name."""

    root: Path
    generated: Path
    outputs: frozenset[Path]  # every file a current spec owns under the generated directory
    pins_file: Path | None = None  # pyproject.toml: `upgrade --apply` changes its pins in the same commit

    def problem(self, path: Path) -> str | None:
        """Why `path` may not be written by a journaled write; None when it may."""
        link = symlinked(self.root, path)
        if link is not None:
            return f"{_rel(self.root, link)!r} is a symlink (patchgen writes through none)"
        if path == self.pins_file:
            return None
        if path not in self.outputs or not path.is_relative_to(self.generated):
            return (
                f"{_rel(self.root, path)!r} is not an output of a spec (only the files `patchgen regen --all` "
                f"writes may be)"
            )
        return None

    def directory_problem(self, path: Path) -> str | None:
        if not path.is_relative_to(self.generated) or path == self.generated:
            return (
                f"directory {_rel(self.root, path)!r} is not inside the generated directory "
                f"{_rel(self.root, self.generated)!r}"
            )
        link = symlinked(self.root, path)
        return None if link is None else f"{_rel(self.root, link)!r} is a symlink (patchgen writes through none)"


def symlinked(root: Path, path: Path) -> Path | None:
    """The first component of `path` below `root` (the path itself included) that is a symlink, by lstat."""
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None  # nothing below a missing component (or a file) exists
        if stat.S_ISLNK(mode):
            return current
    return None


def pins_only(candidate: bytes, current: bytes) -> bool:
    """Whether a pyproject.toml text differs from the current one in nothing but the pinned versions (the
    `[tool.patchgen] pins` values and the exact requirements `config.with_pins` moves with them)."""
    try:
        texts = candidate.decode("utf-8"), current.decode("utf-8")
        pins = tomllib.loads(texts[1])["tool"]["patchgen"]["pins"]
        neutral = {name: "0" for name in pins}
        return with_pins(texts[0], neutral) == with_pins(texts[1], neutral)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError, PatchgenError):
        return False


def verify(confinement: Confinement) -> dict | None:
    """The journal to replay, proven safe (see the module docstring); None when the staging directory holds no
    journal (leftovers of a write killed before its commit point: all patchgen's own, safe to discard).
    Raises Refused."""
    root, txn = confinement.root, confinement.root / TXN_DIR
    mode = os.lstat(txn).st_mode
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise Refused(f"{txn} is {'a symlink' if stat.S_ISLNK(mode) else 'not a directory'}")
    names = sorted(os.listdir(txn))
    for name in names:
        if not (name in OWN_NAMES or STAGED.fullmatch(name)) or not stat.S_ISREG(os.lstat(txn / name).st_mode):
            raise Refused(f"{txn} holds {name!r}, which is not a file patchgen stages")
    if JOURNAL not in names:
        return None
    journal = _parse(txn / JOURNAL)
    rollback = ROLLBACK in names
    targets = set()
    for index, entry in enumerate(journal["entries"]):
        target = root / entry["target"]
        if target in targets:
            raise Refused(f"{entry['target']!r} is named twice")
        targets.add(target)
        problem = confinement.problem(target)
        if problem is not None:
            raise Refused(problem)
        _check_state(txn, index, entry, target, rollback, confinement)
    for directory in journal["dirs"]:
        problem = confinement.directory_problem(root / directory)
        if problem is not None:
            raise Refused(problem)
    return journal


def _parse(path: Path) -> dict:
    """The journal's JSON, shaped as `files._stage` writes it (every path plain and relative)."""
    if path.stat().st_size > MAX_JOURNAL_BYTES:
        raise Refused(f"larger than {MAX_JOURNAL_BYTES // 1024} KiB")
    try:
        journal = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused(f"not JSON ({exc})") from None
    if not isinstance(journal, dict) or set(journal) != {"entries", "dirs"}:
        raise Refused("not a journal patchgen writes (expected the keys 'entries' and 'dirs')")
    entries, dirs = journal["entries"], journal["dirs"]
    if not isinstance(entries, list) or not isinstance(dirs, list) or not all(map(_plain, dirs)):
        raise Refused("'entries' and 'dirs' must be lists, 'dirs' of plain relative paths")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not set(entry) <= _ENTRY_KEYS or not _plain(entry.get("target")):
            raise Refused(f"entry {index} is not a plain relative target with its staged files")
        if entry.get("new") != f"{index}.new" or entry.get("old") not in (None, f"{index}.old"):
            raise Refused(f"entry {index} ({entry['target']!r}) names staged files that are not its own")
        for key in ("new", "old"):
            digest = entry.get(f"{key}_sha256")
            if entry[key] is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
                raise Refused(
                    f"entry {index} ({entry['target']!r}) records no sha256 of its {key} file (a journal of an "
                    f"older patchgen?)"
                )
    return journal


def _check_state(txn: Path, index: int, entry: dict, target: Path, rollback: bool, confinement: Confinement) -> None:
    """The staged file, the backup and the target are each in a state the interrupted write could have left:
    staged (target still old), renamed into place (target new), or, once rolling back, restored (target old)."""
    new, old = _digest(txn / entry["new"]), _digest(txn / entry["old"]) if entry["old"] else None
    for name, digest in ((entry["new"], new), (entry["old"], old)):
        if digest is not None and digest != entry[f"{name.split('.')[1]}_sha256"]:
            raise Refused(f"staged file {name} does not have the sha256 the journal recorded for {entry['target']!r}")
    if os.path.lexists(target) and not stat.S_ISREG(os.lstat(target).st_mode):
        raise Refused(f"{entry['target']!r} is not a regular file")
    current = _digest(target)
    before = entry.get("old_sha256")  # None: the target did not exist
    applied_or_restored = {entry["new_sha256"], before} if rollback else {entry["new_sha256"]}
    if current not in ({before} if new is not None else applied_or_restored):
        raise Refused(f"{entry['target']!r} changed since the interrupted write (its sha256 is not the recorded one)")
    if entry["old"] is not None and old is None and not (rollback and current == before):
        raise Refused(f"the backup {entry['old']} of {entry['target']!r} is missing")
    if target == confinement.pins_file:
        for staged in (txn / name for name in (entry["new"], entry["old"]) if name):
            if os.path.lexists(staged) and not pins_only(staged.read_bytes(), target.read_bytes()):
                raise Refused(f"{_rel(confinement.root, target)}: changes more than the pins")


def _digest(path: Path) -> str | None:
    return file_sha256(path) if os.path.lexists(path) else None


def _plain(path: object) -> bool:
    """A relative POSIX path of printable names, without `.`, `..`, empty parts or backslashes."""
    if not isinstance(path, str) or not path or "\\" in path or not path.isprintable():
        return False
    plain = PurePosixPath(path)
    return not plain.is_absolute() and plain.as_posix() == path and not {".", ".."} & set(plain.parts)


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
