"""Cached conditions: each sample's ``get_condition`` output (VAE latents + text/image embeddings), computed once and
stored as sharded safetensors, so training reads tensors instead of running the VAE and the text encoders.

**Keys.** A sample's key is the sha256 of: the cache format version, the condition model's fingerprint, the caption,
the sha256 of every media file's bytes, the media kind and the bucket (frames, height, width) and frame stride the
pixels were resized/cropped/sampled to. The condition model's fingerprint (``condition_fingerprint``) is the sha256
of its type, the source of the condition-model code, and every file of the pipeline directory except the
transformer(s) and the scheduler (neither feeds ``get_condition``), by relative path and content. A changed media
file, caption, bucket, encoder weight or config, or condition-model code is therefore a different key: the old entry
is never read again, and the sample is recomputed.

**Files.** ``<dir>/conditions-<id>.safetensors`` shards, each holding several samples as ``<key>/latents`` and
``<key>/context/<name>`` tensors (float32 as computed), written to a temporary name and renamed into place (a crash
leaves no partial shard under a shard name). Shards are self-describing; the index (key -> shard) is rebuilt by
reading their headers. ``<dir>/file_digests.json`` memoises file hashes by (size, mtime): unchanged files are not
re-read on the next start.

**Integrity.** Like a checkpoint's files, every shard's size and sha256 are recorded when it is written, in
``conditions-<id>.sha256`` beside it (JSON ``{"size", "sha256"}``, written before the shard is renamed into place),
and checked before its tensors are read (``verify``, split over the ranks, once per run; ``get`` checks a shard it
reads unverified): a shard whose bytes changed is a ``CacheError`` naming it, never a silent NaN. A shard without
its record is not one this code finished: its samples are recomputed. Conditions that are not finite (the condition
model produced NaN or inf) are refused when they are written (``NonFiniteConditionError``, naming the sample). A
planted shard of NaN with recomputed hashes still verifies; its NaN then stops the run at the first step that reads
it (``runtime/train/finite.py``, naming the shard).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed import ProcessGroup

from runtime.checkpoint.verify import damaged_files, hash_file
from runtime.data.dit.media import MediaError

__all__ = [
    "CACHE_FORMAT",
    "CacheError",
    "ConditionCache",
    "FileDigests",
    "NonFiniteConditionError",
    "condition_fingerprint",
    "sample_key",
]

CACHE_FORMAT = 2  # 1: shards without recorded hashes
_SHARD_PREFIX = "conditions-"
_SHARD_SUFFIX = ".safetensors"
_DIGEST_SUFFIX = ".sha256"
_MEMO = "file_digests.json"
_NOT_CONDITION_INPUTS = ("transformer", "transformer_2", "scheduler")  # pipeline parts get_condition never reads


class CacheError(ValueError):
    """A cache shard whose bytes are not the ones recorded when it was written; one line naming it."""


class NonFiniteConditionError(MediaError):
    """The condition model's output for a sample is not finite: never cached, never trained on. A ``MediaError``
    (a property of the sample's data), so that a rank computing conditions raises it on every rank."""


def digest_path(shard: Path) -> Path:
    """Where the size and sha256 of ``shard`` are recorded."""
    return shard.with_name(shard.name[: -len(_SHARD_SUFFIX)] + _DIGEST_SUFFIX)


def _read_digest(shard: Path) -> dict[str, Any] | None:
    """The recorded ``{"size", "sha256"}`` of ``shard``; None when there is no well-formed record."""
    try:
        entry = json.loads(digest_path(shard).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
        and len(entry["sha256"]) == 64
    )
    return {"size": entry["size"], "sha256": entry["sha256"]} if ok else None


class FileDigests:
    """sha256 of files, memoised by (size, mtime_ns) in ``memo`` (a JSON file; None: not memoised).

    A file rewritten with the same size and modification time keeps its old digest: tools that preserve mtimes
    while changing content (``touch -r``, some ``rsync`` modes) must be followed by deleting the memo.
    """

    def __init__(self, memo: Path | None = None) -> None:
        self.memo = memo
        self._known: dict[str, list] = {}
        self._dirty = False
        if memo is not None and memo.is_file():
            try:
                data = json.loads(memo.read_text(encoding="utf-8"))
                if isinstance(data, dict) and data.get("version") == CACHE_FORMAT:
                    self._known = {k: v for k, v in data.get("files", {}).items() if isinstance(v, list)}
            except (OSError, ValueError):
                self._known = {}

    def digest(self, path: Path) -> str:
        path = Path(os.path.abspath(path))
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        known = self._known.get(str(path))
        if known is not None and known[:2] == stamp:
            return known[2]
        digest = hash_file(path)
        self._known[str(path)] = [*stamp, digest]
        self._dirty = True
        return digest

    def update(self, other: Mapping[str, list]) -> None:
        """Merge entries computed elsewhere (another rank's ``entries()``)."""
        for key, value in other.items():
            if self._known.get(key) != value:
                self._known[key] = value
                self._dirty = True

    def entries(self, paths: Iterable[Path]) -> dict[str, list]:
        return {str(Path(os.path.abspath(p))): self._known[str(Path(os.path.abspath(p)))] for p in paths}

    def save(self) -> None:
        if self.memo is None or not self._dirty:
            return
        text = json.dumps({"version": CACHE_FORMAT, "files": self._known}, sort_keys=True)
        _write_atomically(self.memo, text.encode())
        self._dirty = False


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _code_digest(condition_model_class: type) -> str:
    """The source of the condition model's module and of everything it inherits from in ``runtime``."""
    h = hashlib.sha256()
    for cls in condition_model_class.__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and cls.__module__.startswith("runtime."):
            h.update(inspect.getsource(module).encode())
    return h.hexdigest()


def condition_fingerprint(
    pipeline_dir: str | os.PathLike,
    condition_model_type: str,
    condition_model_class: type,
    digests: FileDigests,
    options: Mapping[str, Any] | None = None,
) -> str:
    """sha256 of what ``get_condition`` depends on (see the module docstring); ``options`` are the condition-model
    options that change its outputs (none today: the recipe options only affect ``process_condition``)."""
    root = Path(pipeline_dir)
    parts: list[Any] = [CACHE_FORMAT, condition_model_type, _code_digest(condition_model_class), dict(options or {})]
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if relative.parts[0] in _NOT_CONDITION_INPUTS or any(part.startswith(".") for part in relative.parts):
            continue
        parts.append([relative.as_posix(), digests.digest(path)])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def sample_key(
    fingerprint: str, caption: str, media_digests: Sequence[str], kind: str, bucket: Sequence[int], frame_stride: int
) -> str:
    """The cache key of one sample's conditions."""
    record = {
        "format": CACHE_FORMAT,
        "condition": fingerprint,
        "caption": caption,
        "media": list(media_digests),
        "kind": kind,
        "bucket": list(bucket),
        "frame_stride": frame_stride,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


Condition = dict[str, Any]  # {"latents": Tensor, "context": {name: Tensor}}


class ConditionCache:
    """Sharded safetensors of per-sample conditions under ``directory`` (created if missing)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._index: dict[str, tuple[Path, list[str]]] = {}
        self._handles: dict[Path, Any] = {}
        self._digests: dict[Path, dict[str, Any]] = {}
        self._verified: set[Path] = set()
        self.unreadable: list[str] = []  # shards that failed to open on the last refresh (their samples recompute)
        self.labels: dict[str, str] = {}  # key -> what the sample is (data file:line), for messages
        self.refresh()

    def shards(self) -> list[Path]:
        return sorted(self.directory.glob(f"{_SHARD_PREFIX}*{_SHARD_SUFFIX}"))

    def refresh(self) -> None:
        """Re-read every shard's header and recorded digest (after this or another process wrote shards)."""
        index: dict[str, tuple[Path, list[str]]] = {}
        self._handles.clear()
        self._digests, self._verified = {}, set()
        self.unreadable = []
        for shard in self.shards():
            digest = _read_digest(shard)
            if digest is None:  # not finished by this code (or written before hashes were recorded): recomputed
                self.unreadable.append(f"{shard}: no record of its size and sha256 ({digest_path(shard).name})")
                continue
            try:
                with safe_open(shard, framework="pt") as f:
                    names = list(f.keys())
            except Exception as exc:  # a damaged shard: its samples are simply missing and get recomputed
                self.unreadable.append(f"{shard}: {exc}")
                continue
            self._digests[shard] = digest
            found: dict[str, list[str]] = {}
            for name in names:
                found.setdefault(name.split("/", 1)[0], []).append(name)
            for key, entries in found.items():
                index.setdefault(key, (shard, entries))
        self._index = index

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def shard_of(self, key: str) -> Path:
        return self._index[key][0]

    def describe(self, key: str) -> str:
        """The sample's label (its data file:line when ``labels`` has it) and, if cached, its shard's name."""
        label = self.labels.get(key, f"sample {key[:16]}")
        return f"{label} (cached in {self.shard_of(key).name})" if key in self._index else label

    def verify(self, keys: Iterable[str], *, process_group: ProcessGroup | None = None) -> None:
        """Check the size and sha256 of every shard holding one of ``keys`` against its record, before any of their
        tensors are read; ``CacheError`` naming the first bad shard. Collective when distributed: the hashing is
        split over the ranks and every rank raises the same error or none does."""
        shards = sorted({self._index[key][0] for key in keys if key in self._index})
        problems = damaged_files(
            self.directory, {s.name: self._digests[s] for s in shards}, process_group=process_group
        )
        if problems:
            more = f" (and {len(problems) - 1} more damaged shards)" if len(problems) > 1 else ""
            raise CacheError(
                f"condition shard {self.directory / problems[0][0]} is damaged: {problems[0][1]}{more}; delete it "
                f"(and its {_DIGEST_SUFFIX} record) to have its samples recomputed"
            )
        self._verified.update(shards)

    def _check(self, shard: Path) -> None:
        """One shard's bytes against its record, on this rank alone (a shard read without ``verify``)."""
        digest = self._digests[shard]
        if shard.stat().st_size != digest["size"] or hash_file(shard) != digest["sha256"]:
            raise CacheError(
                f"condition shard {shard} is damaged: its size or sha256 differs from the recorded one (the file "
                f"changed after it was written); delete it (and its {_DIGEST_SUFFIX} record) to have its samples "
                f"recomputed"
            )
        self._verified.add(shard)

    def get(self, key: str) -> Condition:
        shard, names = self._index[key]
        handle = self._handles.get(shard)
        if handle is None:
            if shard not in self._verified:
                self._check(shard)
            handle = self._handles[shard] = safe_open(shard, framework="pt")
        prefix = f"{key}/"
        latents, context = None, {}
        for name in sorted(names):
            rest = name[len(prefix) :]
            if rest == "latents":
                latents = handle.get_tensor(name)
            elif rest.startswith("context/"):
                context[rest[len("context/") :]] = handle.get_tensor(name)
        if latents is None:
            raise KeyError(f"{shard}: no latents for {key}")
        return {"latents": latents, "context": context}

    def writer(self, max_samples: int = 64) -> ShardWriter:
        return ShardWriter(self, max_samples)


def _not_finite(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


class ShardWriter:
    """Collects conditions and writes them as a shard every ``max_samples`` samples (and on ``close``)."""

    def __init__(self, cache: ConditionCache, max_samples: int) -> None:
        self.cache, self.max_samples = cache, max_samples
        self._pending: dict[str, torch.Tensor] = {}
        self._keys: list[str] = []
        self.written: list[Path] = []

    def add(self, key: str, latents: torch.Tensor, context: Mapping[str, Any]) -> None:
        """Queue one sample's conditions; ``NonFiniteConditionError`` (nothing queued) when any is NaN or inf."""
        if key in self._keys:
            return
        for name, value in context.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"condition context {name!r} is a {type(value).__name__}; only tensors are cached")
        bad = [name for name, value in (("latents", latents), *context.items()) if _not_finite(value)]
        if bad:
            raise NonFiniteConditionError(
                f"{self.cache.labels.get(key, f'sample {key[:16]}')}: the condition model's {', '.join(bad)} for "
                f"this sample are not finite (NaN or inf); nothing of it was cached (check the sample's media and "
                f"the condition model's weights)"
            )
        self._pending[f"{key}/latents"] = latents.detach().to("cpu").clone().contiguous()
        for name, value in context.items():
            self._pending[f"{key}/context/{name}"] = value.detach().to("cpu").clone().contiguous()
        self._keys.append(key)
        if len(self._keys) >= self.max_samples:
            self.flush()

    def flush(self) -> None:
        if not self._keys:
            return
        shard_id = hashlib.sha256("\n".join(sorted(self._keys)).encode()).hexdigest()[:24]
        final = self.cache.directory / f"{_SHARD_PREFIX}{shard_id}{_SHARD_SUFFIX}"
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=self.cache.directory)
        os.close(fd)
        try:
            save_file(self._pending, tmp, metadata={"format": "patchgen-dit-conditions", "version": str(CACHE_FORMAT)})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            # the record goes first: a shard under its final name always has one (a crash between leaves a record
            # without a shard, overwritten by the next write of that shard)
            record = {"size": Path(tmp).stat().st_size, "sha256": hash_file(Path(tmp))}
            _write_atomically(digest_path(final), json.dumps(record).encode())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.written.append(final)
        self._pending, self._keys = {}, []

    def close(self) -> None:
        self.flush()
