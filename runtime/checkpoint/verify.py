"""Checkpoint integrity: every file's size and sha256 in the completion marker, checked before a resume reads it.

A shard with a few flipped bytes still unpickles and loads: training then goes on from garbage (``loss nan``) with
exit code 0. So the marker written last (``COMPLETE``, JSON) lists every other file of the checkpoint with its size
and sha256, and ``verify_checkpoint`` re-hashes them all before anything is loaded; any difference is a
``CheckpointError`` whose one-line message names the checkpoint and the first bad file.

Costs. DCP's files are hashed while DCP writes them (``HashingFileSystemWriter`` wraps its output streams), so saving
reads nothing back; the per-rank state files are hashed from memory. Verifying reads every byte once, split over the
ranks (rank r hashes files r, r + world, ...), at about the sha256 speed of a core or the file system's read speed,
whichever is lower (docs/training.md gives figures).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from runtime.checkpoint.discovery import COMPLETE_MARKER, describe_checkpoints
from runtime.checkpoint.identity import is_identity

logger = logging.getLogger(__name__)

# 1: per-rank state pickled (rank_N.pt), no file hashes; 2: no model identity. Neither is read any more.
FORMAT_VERSION = 3
_OLD_FORMATS = {
    1: "pickled per-rank state, no file hashes",
    2: "it does not record the model it was saved from, so a resume cannot be checked against the run's model",
}

FileDigests = dict[str, dict[str, Any]]  # file name -> {"size": int, "sha256": hex}


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (incomplete, damaged or of an unknown format); one line naming it."""


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def hash_file(path: Path) -> str:
    """sha256 of a file's bytes, read in large blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest_bytes(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ------------------------------------------------------------------------------------------------ hash while writing


class _HashingStream(io.RawIOBase):
    """Forwards writes to ``raw`` and hashes them on the way. A seek makes the digest unusable (``valid`` False)."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw, self.sha, self.size, self.valid = raw, hashlib.sha256(), 0, True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self.sha.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.valid = False  # bytes may be overwritten: the file is hashed from disk instead
        return self.raw.seek(offset, whence)

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording size and sha256 of every file written through it (by final name)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: FileDigests = {}
        self._lock = threading.Lock()  # DCP may write from several threads

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        name = Path(path).name
        with self._lock:
            if stream.valid and "a" not in mode and Path(path).stat().st_size == stream.size:
                self.digests[name] = {"size": stream.size, "sha256": stream.sha.hexdigest()}
            else:
                self.digests.pop(name, None)  # hashed from disk when the marker is written

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        with self._lock:
            digest = self.digests.pop(Path(path).name, None)
            if digest is not None:
                self.digests[Path(new_path).name] = digest

    def rm_file(self, path: Any) -> None:
        super().rm_file(path)
        with self._lock:
            self.digests.pop(Path(path).name, None)


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files are hashed as they are written: ``digests`` after ``dcp.save``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = HashingFileSystem()

    @property
    def digests(self) -> FileDigests:
        return dict(self.fs.digests)


def gather_digests(local: FileDigests, process_group: ProcessGroup | None = None) -> FileDigests:
    """Every rank's digests, merged (collective when distributed)."""
    if not _dist_ready() or dist.get_world_size(process_group) == 1:
        return dict(local)
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, local, group=process_group)
    merged: FileDigests = {}
    for part in everyone:
        merged.update(part)
    return merged


def complete_digests(directory: Path, known: FileDigests) -> FileDigests:
    """``known`` plus a digest of every other file in ``directory`` (hashed from disk), the marker excluded."""
    files: FileDigests = {}
    for path in sorted(directory.iterdir()):
        if path.name == COMPLETE_MARKER or not path.is_file():
            continue
        if path.name in known:
            files[path.name] = known[path.name]
        else:
            logger.debug("hashing %s from disk (not hashed while written)", path)
            files[path.name] = {"size": path.stat().st_size, "sha256": hash_file(path)}
    return files


# ------------------------------------------------------------------------------------------------------ verification


def _bad_marker(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged: its completion marker {COMPLETE_MARKER} {why}")


def read_marker(path: Path) -> dict[str, Any]:
    """The parsed completion marker of checkpoint ``path``; ``CheckpointError`` if missing, unreadable or malformed."""
    path = Path(path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what} ({describe_checkpoints(path.parent)})")
    marker_path = path / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is not complete (no {COMPLETE_MARKER} marker: a save that never finished, or not a "
            f"checkpoint)"
        )
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _bad_marker(path, f"is not valid JSON ({exc})") from None
    if not isinstance(marker, dict):
        raise _bad_marker(path, "is not a JSON object")
    version = marker.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version in _OLD_FORMATS:
            raise CheckpointError(
                f"checkpoint {path} has format version {version} ({_OLD_FORMATS[version]}), which this runtime no "
                f"longer reads"
            )
        raise _bad_marker(path, f"has format_version {version!r}, expected {FORMAT_VERSION}")
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        raise _bad_marker(path, "lists no files")
    for name, entry in files.items():
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise _bad_marker(path, f"lists an invalid file name {name!r}")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64
        ):
            raise _bad_marker(path, f"has a malformed entry for {name}")
    if not isinstance(marker.get("world_size"), int) or marker["world_size"] < 1:
        raise _bad_marker(path, "has no valid world_size")
    if not is_identity(marker.get("model")):
        raise _bad_marker(path, "does not name the model it was saved from (model: {type, config})")
    return marker


def damaged_files(
    directory: Path, files: FileDigests, *, process_group: ProcessGroup | None = None
) -> list[tuple[str, str]]:
    """``(name, what is wrong)`` for every file of ``files`` in ``directory`` that is missing or whose size or sha256
    differs, sorted; empty when all match. Collective when distributed: sizes are checked on every rank, the hashing
    is split over the ranks (rank r hashes files r, r + world, ...) and every rank gets every finding."""
    problems: list[tuple[str, str]] = []
    to_hash: list[str] = []
    for name, entry in sorted(files.items()):
        file = directory / name
        if not file.is_file():
            problems.append((name, f"{name} is missing"))
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            why = f"{name} has size {size}, the record says {entry['size']} (truncated or rewritten)"
            problems.append((name, why))
            continue
        to_hash.append(name)
    rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if _dist_ready() else (0, 1)
    for name in to_hash[rank::world]:
        if hash_file(directory / name) != files[name]["sha256"]:
            why = f"{name}'s sha256 differs from the recorded one (the file changed after it was written)"
            problems.append((name, why))
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, problems, group=process_group)
        problems = [p for part in everyone for p in part]
    return sorted(problems)


def verify_checkpoint(path: Path, *, process_group: ProcessGroup | None = None) -> dict[str, Any]:
    """Check every file of checkpoint ``path`` against its marker; return the marker. Collective when distributed.

    Every rank raises the same ``CheckpointError`` (first problem, and how many more) or none does.
    """
    path = Path(path)
    marker = read_marker(path)
    problems = damaged_files(path, marker["files"], process_group=process_group)
    if problems:
        more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is damaged: {problems[0][1]}{more}")
    return marker
