from __future__ import annotations

import random

import pytest
import torch

from runtime.data.loader import plan_rows
from runtime.data.text.packing import has_targets, pack_row
from runtime.data.text.tokenization import TokenizedSample

BUDGET = 64


def pack_samples(samples: list[TokenizedSample], token_budget: int) -> list[dict[str, torch.Tensor]]:
    """All samples, in the given order, packed into rows (``plan_rows`` then ``pack_row``, as the loader does)."""
    rows = plan_rows([len(s) for s in samples], token_budget)
    return [pack_row([samples[i] for i in row], token_budget) for row in rows]


def random_samples(n: int, seed: int = 0, max_len: int = 90) -> list[TokenizedSample]:
    """Samples with distinct token ids (so every token can be traced) and some masked labels (chat-like)."""
    rng = random.Random(seed)
    samples, next_id = [], 1
    for _ in range(n):
        length = rng.randint(1, max_len)
        ids = tuple(range(next_id, next_id + length))
        next_id += length
        labels = tuple(-100 if rng.random() < 0.3 else t for t in ids)
        samples.append(TokenizedSample(ids, labels))
    return samples


def test_plan_respects_budget_and_uses_every_sample_once() -> None:
    lengths = [random.Random(i).randint(1, 90) for i in range(200)]
    for open_rows in (1, 4, 16):
        rows = plan_rows(lengths, BUDGET, open_rows)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(min(lengths[i], BUDGET) for i in row) <= BUDGET for row in rows)
        assert all(row == sorted(row) for row in rows)  # a row keeps the input order of its samples
    assert plan_rows(lengths, BUDGET) == plan_rows(lengths, BUDGET)
    # A wider window packs at least as tightly as next-fit here.
    assert len(plan_rows(lengths, BUDGET, 16)) <= len(plan_rows(lengths, BUDGET, 1))


def test_plan_examples() -> None:
    assert plan_rows([3, 3, 3], 6, open_rows=1) == [[0, 1], [2]]
    assert plan_rows([4, 4, 2, 2], 6, open_rows=2) == [[0, 2], [1, 3]]
    assert plan_rows([10, 1], 4) == [[0], [1]]  # over-long sample: counted as truncated to the budget
    with pytest.raises(ValueError, match="empty"):
        plan_rows([2, 0], 4)
    with pytest.raises(ValueError, match="token_budget"):
        plan_rows([1], 0)


def test_rows_hold_every_token_once_with_restarting_positions_and_no_cross_boundary_label() -> None:
    samples = random_samples(120)
    rows = pack_samples(samples, BUDGET)
    expected_tokens = [t for s in samples for t in s.input_ids[:BUDGET]]
    seen = []
    for row in rows:
        ids, labels, pos = row["input_ids"], row["labels"], row["position_ids"]
        assert ids.dtype == labels.dtype == pos.dtype == torch.long
        assert ids.shape == labels.shape == pos.shape and ids.ndim == 1
        assert 0 < len(ids) <= BUDGET
        starts = (pos == 0).nonzero().flatten().tolist()
        assert starts[0] == 0
        ends = [*starts[1:], len(ids)]
        for start, end in zip(starts, ends, strict=True):
            assert pos[start:end].tolist() == list(range(end - start))  # positions restart per sample
            # Recover the sample from its first token id and compare contents.
            sample = next(s for s in samples if s.input_ids[0] == ids[start].item())
            n = min(len(sample), BUDGET)
            assert ids[start:end].tolist() == list(sample.input_ids[:n])
            assert labels[start].item() == -100  # first token: nobody's target
            assert labels[start + 1 : end].tolist() == list(sample.labels[1:n])
        # The loss target of position t is labels[t + 1]; at every sample boundary it must be ignored.
        for start in starts[1:]:
            assert labels[start].item() == -100
        seen.extend(ids.tolist())
    assert sorted(seen) == sorted(expected_tokens)


def test_long_sample_is_truncated_to_the_budget() -> None:
    sample = TokenizedSample(tuple(range(1, 101)), tuple(range(1, 101)))
    row = pack_row([sample], BUDGET)
    assert row["input_ids"].tolist() == list(range(1, BUDGET + 1))
    assert row["position_ids"].tolist() == list(range(BUDGET))
    with pytest.raises(ValueError, match="more than the budget"):
        pack_row([sample, sample], BUDGET)


def test_has_targets_looks_only_within_the_budget_and_past_the_first_token() -> None:
    reply_late = TokenizedSample(tuple(range(1, 11)), (-100,) * 8 + (9, 10))
    assert has_targets(reply_late, 10)
    assert not has_targets(reply_late, 8)
    assert not has_targets(TokenizedSample((5, 6), (5, -100)), 10)
