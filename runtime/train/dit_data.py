"""The DiT trainer's data side: the data set (probed over the ranks), and where each step's conditions come from:
the condition cache (``runtime/diffusion/cache.py``; missing entries are computed first, spread over the ranks) or
the condition model on the fly.

Either way ``get_condition`` runs on one sample at a time, so a sample's latents and embeddings do not depend on which
samples share its batch, and cached and on-the-fly runs see bitwise the same tensors.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from runtime.config.errors import ConfigError
from runtime.data.dit.buckets import MediaRules, parse_buckets
from runtime.data.dit.dataset import DiTDataset
from runtime.data.dit.manifest import MediaSample, read_media_jsonl
from runtime.data.dit.media import MediaError, probe
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig

__all__ = [
    "CachedConditions",
    "LiveConditions",
    "build_dataset",
    "gather_over_ranks",
    "media_rules",
    "read_dit_samples",
]

T = TypeVar("T")
R = TypeVar("R")


def media_rules(condition_model_class: type) -> MediaRules:
    return MediaRules(
        video=condition_model_class.video,
        pixel_multiple=condition_model_class.pixel_multiple,
        temporal_multiple=condition_model_class.temporal_multiple,
    )


def read_dit_samples(config: RunConfig) -> list[MediaSample]:
    """Parse the data file (every referenced file must exist); one-line ``ConfigError`` naming ``file:line``."""
    path = Path(config.data.path)
    if not path.is_file():
        raise ConfigError(f"data.path: {path}: {'not a file' if path.exists() else 'file not found'}")
    try:
        samples = read_media_jsonl(path, config.data.media_dir)
    except ValueError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"data.path: {path}: cannot read it: {exc.strerror or exc}") from None
    if not samples:
        raise ConfigError(f"data.path: {path}: no samples (the file is empty or holds only blank lines)")
    return samples


def gather_over_ranks(items: Sequence[T], fn: Callable[[T], R], state: ParallelState) -> list[R]:
    """``[fn(x) for x in items]`` computed by all ranks together (rank r takes items r, r + world, ...). A
    ``MediaError``/``ConfigError`` on any rank is raised on every rank (the first one in item order), so no rank is
    left waiting in a collective."""
    world = state.world_size if dist.is_initialized() else 1
    rank = state.rank if world > 1 else 0
    mine: dict[int, Any] = {}
    error: tuple[int, str, str] | None = None
    for index in range(rank, len(items), world):
        try:
            mine[index] = fn(items[index])
        except (MediaError, ConfigError) as exc:
            error = (index, type(exc).__name__, str(exc))
            break
    parts: list[Any] = [(mine, error)]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, (mine, error))
    errors = sorted(e for _, e in parts if e is not None)
    if errors:
        _, kind, message = errors[0]
        raise (MediaError if kind == "MediaError" else ConfigError)(message)
    merged: dict[int, Any] = {}
    for part, _ in parts:
        merged.update(part)
    return [merged[i] for i in range(len(items))]


def build_dataset(config: RunConfig, samples: Sequence[MediaSample], rules: MediaRules, state: ParallelState):
    """Buckets from the config, media probed over the ranks, a bucket per sample; ``ConfigError`` on bad input."""
    try:
        buckets = parse_buckets(config.data.buckets, rules)
        infos = gather_over_ranks(samples, probe, state)
        return DiTDataset.from_probed(samples, infos, buckets, rules, config.data.frame_stride)
    except (MediaError, ValueError) as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("data.") else f"data.path: {message}") from None


# ------------------------------------------------------------------------------------------------------ conditions


def _one_condition(condition_model: Any, dataset: DiTDataset, index: int) -> tuple[torch.Tensor, dict]:
    try:
        pixels = dataset.pixels(index)
    except MediaError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    out = condition_model.get_condition([dataset.samples[index].caption], [pixels])
    return out["latents"][0], out["context"][0]


class LiveConditions:
    """Conditions computed by the condition model at every step (decoding the media each time)."""

    def __init__(self, condition_model: Any, dataset: DiTDataset) -> None:
        self.condition_model, self.dataset = condition_model, dataset

    def __call__(self, indices: Sequence[int]) -> tuple[list[torch.Tensor], list[dict]]:
        pairs = [_one_condition(self.condition_model, self.dataset, i) for i in indices]
        return [p[0] for p in pairs], [p[1] for p in pairs]


@dataclass
class CachedConditions:
    """Conditions read from the cache by each sample's key."""

    cache: Any  # ConditionCache
    keys: Sequence[str]

    def __call__(self, indices: Sequence[int]) -> tuple[list[torch.Tensor], list[dict]]:
        entries = [self.cache.get(self.keys[i]) for i in indices]
        return [e["latents"] for e in entries], [e["context"] for e in entries]


def sample_keys(
    dataset: DiTDataset, fingerprint: str, digests: Any, state: ParallelState
) -> tuple[list[str], dict[str, list]]:
    """Each sample's cache key (media hashed over the ranks) and the digest memo entries every rank computed."""
    from runtime.diffusion.cache import sample_key

    def media_digests(sample: MediaSample) -> tuple[list[str], dict[str, list]]:
        try:
            found = [digests.digest(p) for p in sample.files]
        except OSError as exc:
            raise ConfigError(f"data.path: {sample.where}: cannot read {exc.filename}: {exc.strerror}") from None
        return found, digests.entries(sample.files)

    per_sample = gather_over_ranks(dataset.samples, media_digests, state)
    memo: dict[str, list] = {}
    keys = []
    for index, (found, entries) in enumerate(per_sample):
        memo.update(entries)
        sample, bucket = dataset.samples[index], dataset.buckets[index]
        keys.append(
            sample_key(
                fingerprint,
                sample.caption,
                found,
                sample.kind,
                [bucket.frames, bucket.height, bucket.width],
                dataset.frame_stride,
            )
        )
    return keys, memo


def fill_cache(
    cache: Any,
    keys: Sequence[str],
    dataset: DiTDataset,
    load_condition_model: Callable[[], Any],
    state: ParallelState,
) -> int:
    """Compute the conditions of every sample whose key the cache lacks (spread over the ranks, each writing its
    own shards), then make every rank see them. Returns how many were computed. Collective. Counts are of distinct
    keys: samples with the same caption and media share one entry, computed once."""
    first: dict[str, int] = {}
    for index, key in enumerate(keys):
        if key not in cache:
            first.setdefault(key, index)
    missing = sorted(first.values())
    if missing:
        started = time.perf_counter()
        if state.rank == 0:
            distinct = len(set(keys))
            print(
                f"conditions: computing {len(missing)} of {distinct} distinct conditions ({len(keys)} samples) into "
                f"{cache.directory} ({distinct - len(missing)} cached)",
                file=sys.stderr,
                flush=True,
            )
        condition_model = load_condition_model()  # collective-free; every rank loads its own frozen copy
        writer = cache.writer()

        def compute(index: int) -> bool:
            latents, context = _one_condition(condition_model, dataset, index)
            writer.add(keys[index], latents, context)
            return True

        try:
            gather_over_ranks(missing, compute, state)  # rank r computes missing[r::world]
        finally:
            writer.close()
        del condition_model
        if state.rank == 0:
            print(f"conditions: done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()
    cache.refresh()
    absent = [keys[i] for i in range(len(keys)) if keys[i] not in cache]
    if absent:
        raise ConfigError(
            f"data.cache: {len(absent)} conditions are still missing from {cache.directory} after filling"
        )
    return len(missing)
