from __future__ import annotations

import pickle
import random

import pytest
import torch

from runtime.data.loader import PackedRowSampler
from runtime.data.sampler import Order, epoch_permutation
from runtime.data.samples import read_text_documents
from runtime.data.sp_batch import pad_to_multiple
from runtime.data.text.corpus import corpus_path
from runtime.data.text.packing import TextPackedLoader
from runtime.data.text.tokenization import TokenizedSample, tokenize_samples
from runtime.parallel.state import ParallelState

BUDGET = 48


def make_samples(n: int = 150, seed: int = 0) -> list[TokenizedSample]:
    rng = random.Random(seed)
    samples, next_id = [], 1
    for _ in range(n):
        length = rng.randint(2, 60)
        ids = tuple(range(next_id, next_id + length))
        next_id += length
        samples.append(TokenizedSample(ids, ids))
    return samples


def first_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """The first token id of every sample in a batch: identifies the samples (ids are unique in make_samples)."""
    return batch["input_ids"][0][batch["position_ids"][0] == 0].tolist()


def take(loader, k: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(k)]


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    assert epoch_permutation(50, 1, 0) == epoch_permutation(50, 1, 0)
    assert sorted(epoch_permutation(50, 1, 0)) == list(range(50))
    assert epoch_permutation(50, 1, 0) != epoch_permutation(50, 1, 1)
    assert epoch_permutation(50, 1, 0) != epoch_permutation(50, 2, 0)


def test_batches_have_a_leading_batch_dim_and_fit_the_budget() -> None:
    loader = TextPackedLoader(make_samples(), BUDGET, Order(seed=3))
    for batch in take(loader, 10):
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        shapes = {v.shape for v in batch.values()}
        assert len(shapes) == 1
        (shape,) = shapes
        assert shape[0] == 1 and 0 < shape[1] <= BUDGET
        assert all(v.dtype == torch.long for v in batch.values())
        padded = pad_to_multiple(batch, 4)  # the rows are what the SP sharding expects
        assert padded["input_ids"].shape[1] % 4 == 0


def test_dp_ranks_see_disjoint_samples_and_take_equal_steps() -> None:
    samples, dp_size = make_samples(), 3
    loaders = [
        TextPackedLoader(samples, BUDGET, Order(seed=5, dp_rank=r, dp_size=dp_size, num_epochs=1))
        for r in range(dp_size)
    ]
    steps = {loader.steps_in_epoch(0) for loader in loaders}
    assert len(steps) == 1
    per_rank = [[i for batch in loader for i in first_ids(batch)] for loader in loaders]
    assert [len(b) for b in per_rank] != [0] * dp_size
    union = [i for ids in per_rank for i in ids]
    assert len(union) == len(set(union))  # disjoint
    dropped = {s.input_ids[0] for s in samples} - set(union)
    # Only the plan's last len(rows) % dp_size rows may go unused, so few samples are left out.
    assert len(dropped) <= (dp_size - 1) * BUDGET // 2


def test_every_sample_is_used_once_per_epoch_on_a_single_rank() -> None:
    samples = make_samples(80)
    loader = TextPackedLoader(samples, BUDGET, Order(seed=1, num_epochs=2))
    epochs: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(loader.steps_in_epoch(0) + loader.steps_in_epoch(1)):
        batch = next(loader)
        epochs[loader.epoch].extend(first_ids(batch))
    with pytest.raises(StopIteration):
        next(loader)
    for ids in epochs.values():
        assert sorted(ids) == sorted(s.input_ids[0] for s in samples)
    assert epochs[0] != epochs[1]  # reshuffled and repacked every epoch


@pytest.mark.parametrize("k", [0, 1, 7, 13])
def test_resume_continues_with_the_very_next_batch(k: int) -> None:
    samples = make_samples()
    uninterrupted = TextPackedLoader(samples, BUDGET, Order(seed=11, dp_rank=1, dp_size=2))
    reference = take(uninterrupted, 30)  # crosses into the second epoch

    first = TextPackedLoader(samples, BUDGET, Order(seed=11, dp_rank=1, dp_size=2))
    take(first, k)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert all(type(v) is int for v in state.values())

    resumed = TextPackedLoader(samples, BUDGET, Order(seed=11, dp_rank=1, dp_size=2))
    resumed.load_state_dict(state)
    for expected, got in zip(reference[k:], take(resumed, 30 - k), strict=True):
        for key in expected:
            assert torch.equal(expected[key], got[key])


def test_state_of_one_dp_rank_restores_another() -> None:
    samples = make_samples()
    rank0 = TextPackedLoader(samples, BUDGET, Order(seed=2, dp_rank=0, dp_size=2))
    rank1 = TextPackedLoader(samples, BUDGET, Order(seed=2, dp_rank=1, dp_size=2))
    take(rank0, 9)
    take(rank1, 9)
    assert rank0.state_dict() == rank1.state_dict()


def test_resume_with_different_data_or_layout_is_refused() -> None:
    samples = make_samples()
    state = TextPackedLoader(samples, BUDGET, Order(seed=2)).state_dict()
    with pytest.raises(ValueError, match="seed"):
        TextPackedLoader(samples, BUDGET, Order(seed=3)).load_state_dict(state)
    with pytest.raises(ValueError, match="dp_size"):
        TextPackedLoader(samples, BUDGET, Order(seed=2, dp_rank=0, dp_size=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        TextPackedLoader(samples[:-1], BUDGET, Order(seed=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        TextPackedLoader(samples, BUDGET, Order(seed=2)).load_state_dict({**state, "position": 10_000})


def test_sp_ranks_of_one_replica_get_identical_rows() -> None:
    """Only dp_rank / dp_size enter the plan, so every SP rank of a replica builds the same loader."""
    samples = make_samples()
    state = ParallelState()  # single process: dp_rank 0 of 1
    a = TextPackedLoader(samples, BUDGET, Order.for_parallel_state(state, seed=4))
    b = TextPackedLoader(samples, BUDGET, Order(seed=4, dp_rank=state.dp_rank, dp_size=state.dp_size))
    for x, y in zip(take(a, 5), take(b, 5), strict=True):
        assert all(torch.equal(x[key], y[key]) for key in x)


def test_samples_without_targets_are_dropped_and_too_little_data_is_an_error() -> None:
    masked = TokenizedSample((1, 2, 3), (-100, -100, -100))
    loader = TextPackedLoader([masked, *make_samples(20)], BUDGET)
    assert loader.num_dropped == 1
    with pytest.raises(ValueError, match="no"):
        TextPackedLoader([masked], BUDGET)
    with pytest.raises(ValueError, match="dp_size"):
        PackedRowSampler([5, 5], 10, Order(dp_rank=0, dp_size=2))  # one row cannot feed two ranks
    with pytest.raises(ValueError, match="dp_rank"):
        PackedRowSampler([5], 10, Order(dp_rank=2, dp_size=2))


def test_end_to_end_on_the_shipped_corpus(tokenizer) -> None:
    documents = read_text_documents(corpus_path(), target_chars=400)[:60]
    samples = tokenize_samples(documents, tokenizer)
    loader = TextPackedLoader(samples, 256, Order(seed=0, num_epochs=1))
    rows = list(loader)
    assert sum((b["position_ids"][0] == 0).sum().item() for b in rows) == len(samples)
    for batch in rows:
        ids, starts = batch["input_ids"][0], (batch["position_ids"][0] == 0).nonzero().flatten()
        # Only a sample alone in its row can have been truncated, so every sample followed by another ends in EOS.
        assert all(ids[s - 1].item() == tokenizer.eos_token_id for s in starts[1:].tolist())
    assert any((b["position_ids"][0] == 0).sum() > 1 for b in rows)  # rows are really packed
