"""The condition cache's progress line counts distinct entries: samples with the same caption and media share one
cache entry, so a brand-new cache reports 0 cached however many samples repeat."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.diffusion.cache import ConditionCache
from runtime.parallel.state import ParallelState
from runtime.train.dit_data import fill_cache


class _Conditions:
    """A condition model's ``get_condition`` (the cache is what is checked here): latents from the caption."""

    def __init__(self) -> None:
        self.calls = 0

    def get_condition(self, captions: list[str], pixels: list) -> dict:
        self.calls += 1
        value = float(len(captions[0]))
        return {"latents": [torch.full((2, 2), value)], "context": [{"embeds": torch.full((3,), value)}]}


def test_a_new_cache_counts_distinct_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    captions = ["a cat", "a cat", "a dog", "a cat", "a dog"]  # 5 samples, 2 distinct entries
    keys = ["k-cat" if c == "a cat" else "k-dog" for c in captions]
    dataset = SimpleNamespace(samples=[SimpleNamespace(caption=c) for c in captions], pixels=lambda i: None)
    model = _Conditions()
    cache = ConditionCache(tmp_path / "cache")
    computed = fill_cache(cache, keys, dataset, lambda: model, ParallelState())
    assert computed == 2 and model.calls == 2 and len(cache) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("conditions: computing")]
    assert line.startswith("conditions: computing 2 of 2 distinct conditions (5 samples) into "), line
    assert line.endswith("(0 cached)"), line
    # a second fill over a cache holding one of them: 1 computed, 1 cached
    keys.append("k-bird")
    dataset.samples.append(SimpleNamespace(caption="a bird"))
    fill_cache(cache, keys, dataset, lambda: model, ParallelState())
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("conditions: computing")]
    assert line.startswith("conditions: computing 1 of 3 distinct conditions (6 samples)") and "(2 cached)" in line
