"""All-or-nothing writes of generated outputs: stage every file, then commit them under a journal.

A commit, under an exclusive lock on the project root:
1. stage: each new text is written and fsynced in `<root>/.patchgen-txn/` (a directory that git-ignores itself),
   each existing target is hard-linked (or copied) there as its backup, and every target is checked to be
   writable (no directory where a file goes, no file where a directory goes);
2. journal: `journal.json` lists (target, staged file, backup, the sha256 of both) and the directories to create;
   it is written to a temp name, fsynced and renamed into place. That rename is the commit point;
3. apply: each staged file is renamed over its target;
4. finish: the journal is removed, then the staging directory.

A failure before the commit point leaves every target untouched; a failure while applying restores every target
from its backup (a `rollback` marker makes that resumable). A process killed at any instant leaves a journal that
the next patchgen command (`recover`, run first by every command) rolls forward, or back when that fails; without a
journal, staging leftovers are discarded. A journal is replayed only once `journal.verify` has proven it names
nothing but what the write may touch (its `Confinement`), in states the write could have left (the journal records
the sha256 of every staged file and backup); a write refuses up front any target a journal of it could not name.
Files get their mode from the umask, like any file the user writes.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from patchgen.errors import PatchgenError
from patchgen.journal import GITIGNORE_NAME, JOURNAL, ROLLBACK, TXN_DIR, Confinement, Refused, pins_only, verify
from patchgen.provenance import file_sha256

PACKAGE_INIT = "# Package of generated modeling files; written by `patchgen regen`.\n"
GITIGNORE = "*\n"  # the staging directory ignores itself (and all it holds) in any git repository


def package_inits(generated_dir: Path, target: Path) -> dict[Path, str]:
    """The `__init__.py` files that make a generated module importable as a package member: one in every
    directory from the generated directory down to the module's, never above it (that is the user's code)."""
    inits = {}
    parent = target.parent
    while parent.is_relative_to(generated_dir):
        inits[parent / "__init__.py"] = PACKAGE_INIT
        if parent == generated_dir:
            break
        parent = parent.parent
    return inits


def write_text_atomic(path: Path, text: str) -> None:
    """One file outside a project's outputs (e.g. a report): a temp file beside it, renamed over it."""
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = stage_beside(path, text.encode("utf-8"))
        os.replace(temp, path)
    except OSError as exc:
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        raise PatchgenError(f"cannot write {path}: {exc.strerror or exc}") from exc


def stage_beside(path: Path, data: bytes) -> Path:
    """A new file beside `path` holding `data`, to be renamed over it. Its name is fresh (random) and it is created
    exclusively (`_write_durable`): whatever someone planted beside the file (a symlink at a predictable staging
    name) is neither followed nor reused."""
    for _ in range(100):
        temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.patchgen-tmp")
        try:
            _write_durable(temp, data)
            return temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free staging name", str(path.parent))


def write_atomic(files: dict[Path, str], confinement: Confinement) -> None:
    """Write every file or none (see the module docstring); every path must be one `confinement` allows."""
    if not files:
        return
    root = confinement.root
    outside = [str(p) for p in files if not p.is_relative_to(root)]
    if outside:
        raise ValueError(f"write_atomic: {outside} outside the project root {root}")
    for path, text in sorted(files.items()):
        problem = confinement.problem(path)
        if problem is None and path == confinement.pins_file and not pins_only(text.encode(), path.read_bytes()):
            problem = "a journaled write may change only its pins"
        if problem is not None:
            raise PatchgenError(f"cannot write {_rel(root, path)}: {problem}; nothing was changed")
    with _locked(root):
        _recover_locked(confinement)
        txn = root / TXN_DIR
        try:
            journal = _stage(root, txn, files)
        except BaseException as exc:
            shutil.rmtree(txn, ignore_errors=True)
            if isinstance(exc, OSError):
                raise PatchgenError(f"cannot stage the outputs in {txn}: {_why(exc)}; nothing was changed") from exc
            raise
        try:
            _roll_forward(root, journal)
        except OSError as exc:
            failed = _why(exc)
            try:
                _roll_back(root, journal)
            except OSError as again:
                raise PatchgenError(
                    f"writing the outputs failed ({failed}) and restoring the old ones failed too ({_why(again)}); "
                    f"the journal in {txn} is kept: rerun any patchgen command to finish restoring them"
                ) from again
            _finish(txn)
            raise PatchgenError(f"cannot write the outputs: {failed}; nothing was changed") from exc
        _finish(txn)


def recover(root: Path, confinement: Callable[[], Confinement]) -> str | None:
    """Finish a commit a killed process left behind: 'rolled forward', 'rolled back', 'discarded' (staging without
    a journal: nothing had changed) or None (nothing to do). Every patchgen command calls this first.
    `confinement` (computed only when there is something to recover) says what the journal may touch."""
    if not os.path.lexists(root / TXN_DIR):
        return None
    with _locked(root):
        return _recover_locked(confinement())


def _recover_locked(confinement: Confinement) -> str | None:
    root = confinement.root
    txn = root / TXN_DIR
    if not os.path.lexists(txn):
        return None
    journal_path = txn / JOURNAL
    try:
        journal = verify(confinement)
    except (Refused, OSError) as exc:
        where = journal_path if os.path.lexists(journal_path) else txn
        why = _why(exc) if isinstance(exc, OSError) else str(exc)
        raise PatchgenError(
            f"{where}: refused to replay an interrupted write: {why}; nothing was changed. If a patchgen write "
            f"really was interrupted, restore generated/ from git (git checkout -- generated); then delete {txn}"
        ) from None
    if journal is None:
        for name in os.listdir(txn):  # verify proved them all patchgen's own regular files
            os.unlink(txn / name)
        os.rmdir(txn)
        return "discarded"
    try:
        if (txn / ROLLBACK).exists():
            _roll_back(root, journal)
            outcome = "rolled back"
        else:
            try:
                _roll_forward(root, journal)
                outcome = "rolled forward"
            except OSError:
                _roll_back(root, journal)
                outcome = "rolled back"
    except OSError as exc:
        raise PatchgenError(
            f"cannot finish an interrupted write recorded in {journal_path}: {_why(exc)}; fix that and rerun"
        ) from exc
    _finish(txn)
    return outcome


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive lock on the project root directory: one commit or recovery at a time."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _stage(root: Path, txn: Path, files: dict[Path, str]) -> dict:
    entries, new_dirs = [], []
    for path in sorted(files):
        new_dirs += [d for d in _missing_dirs(root, path) if d not in new_dirs]
    txn.mkdir()
    _write_durable(txn / GITIGNORE_NAME, GITIGNORE.encode())
    for number, (path, text) in enumerate(sorted(files.items())):
        data = text.encode("utf-8")
        entry = {"target": path.relative_to(root).as_posix(), "new": f"{number}.new", "old": None}
        _write_durable(txn / entry["new"], data)
        entry["new_sha256"] = hashlib.sha256(data).hexdigest()
        if os.path.lexists(path):
            entry["old"] = f"{number}.old"
            try:
                os.link(path, txn / entry["old"], follow_symlinks=False)
            except OSError:  # no hard links here (or an immutable file): a copy is as good a backup
                shutil.copy2(path, txn / entry["old"], follow_symlinks=False)
            entry["old_sha256"] = file_sha256(txn / entry["old"])
        entries.append(entry)
    journal = {"entries": entries, "dirs": [d.relative_to(root).as_posix() for d in new_dirs]}
    _write_durable(txn / (JOURNAL + ".tmp"), json.dumps(journal, indent=1).encode())
    _fsync_dir(txn)
    os.replace(txn / (JOURNAL + ".tmp"), txn / JOURNAL)  # the commit point
    _fsync_dir(txn)
    return journal


def _missing_dirs(root: Path, path: Path) -> list[Path]:
    """The directories to create for `path`, outermost first; a target that cannot be written is an error now,
    before anything is staged."""
    if path.is_dir() and not path.is_symlink():
        raise PatchgenError(f"cannot write {_rel(root, path)}: is a directory; nothing was changed")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise PatchgenError(f"cannot write {_rel(root, path)}: not a regular file; nothing was changed")
    missing = []
    parent = path.parent
    while not parent.is_dir():
        if os.path.lexists(parent):
            raise PatchgenError(
                f"cannot write {_rel(root, path)}: {_rel(root, parent)}: not a directory; nothing was changed"
            )
        missing.append(parent)
        parent = parent.parent
    return missing[::-1]


def _roll_forward(root: Path, journal: dict) -> None:
    txn = root / TXN_DIR
    for directory in journal["dirs"]:
        os.makedirs(root / directory, exist_ok=True)
    for entry in journal["entries"]:
        staged = txn / entry["new"]
        if os.path.lexists(staged):  # gone: renamed into place before an interruption
            os.replace(staged, root / entry["target"])
    for parent in sorted({(root / e["target"]).parent for e in journal["entries"]}):
        _fsync_dir(parent)


def _roll_back(root: Path, journal: dict) -> None:
    """Restore every target from its backup and remove what the commit created; safe to repeat after a kill."""
    txn = root / TXN_DIR
    if not os.path.lexists(txn / ROLLBACK):  # already there when a killed rollback is resumed
        _write_durable(txn / ROLLBACK, b"")
    _fsync_dir(txn)
    for entry in reversed(journal["entries"]):
        target = root / entry["target"]
        if entry["old"] is not None:
            backup = txn / entry["old"]
            if os.path.lexists(backup) and not _same(backup, target):
                os.replace(backup, target)
        elif not os.path.lexists(txn / entry["new"]) and os.path.lexists(target):
            os.unlink(target)  # it did not exist before and our new file is in place
    for directory in reversed(journal["dirs"]):
        with contextlib.suppress(OSError):
            os.rmdir(root / directory)
    for parent in sorted({(root / e["target"]).parent for e in journal["entries"]}):
        if parent.is_dir():
            _fsync_dir(parent)


def _same(backup: Path, target: Path) -> bool:
    """Whether the target still holds the backed-up (old) content, so restoring it would change nothing."""
    if not os.path.lexists(target):
        return False
    if os.path.islink(backup) or os.path.islink(target):
        return os.path.islink(backup) and os.path.islink(target) and os.readlink(backup) == os.readlink(target)
    return os.path.samefile(backup, target) or filecmp.cmp(backup, target, shallow=False)


def _finish(txn: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(txn / JOURNAL)  # from here on there is nothing to recover
    shutil.rmtree(txn, ignore_errors=True)


def _write_durable(path: Path, data: bytes) -> None:
    """Create `path` with `data`, fsynced; mode 0666 minus the umask (never mkstemp's 0600). The file must not
    exist (O_EXCL) and a symlink there is not followed (O_NOFOLLOW): a write never lands in a planted file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def _why(exc: OSError) -> str:
    name = exc.filename
    return f"{name}: {exc.strerror}" if name and exc.strerror else str(exc)
