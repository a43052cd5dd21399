"""The measurements behind two rows of docs/libraries.md: our EMA (runtime/train/ema.py) against torch's
``AveragedModel`` and diffusers' ``EMAModel``, and our packed loader's resume state against torchdata's
``StatefulDataLoader`` (skipped with a note when torchdata is not installed: it is not a dependency).

    .venv/bin/python bench/ema_and_data_state.py

EMA: a 12-block MLP of 1024-wide linears (12.6M parameters), fully trained or with rank-16 LoRA-like adapters only
(the base frozen): the extra memory each keeps, the median time of one update, and the values after 10 updates
against ours. Data state: 20,000 tokenized documents packed into 1024-token rows; the size of the saved state, the
time to resume in the middle of an epoch, and whether the resumed rows equal the uninterrupted ones.
"""

from __future__ import annotations

import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTH, BLOCKS, RANK, DECAY, UPDATES = 1024, 12, 16, 0.999, 10


class Adapter(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Linear(WIDTH, RANK, bias=False)
        self.b = nn.Linear(RANK, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def model(lora: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)]
    return nn.Sequential(*[Adapter(layer) if lora else layer for layer in layers])


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def nudge(m: nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(p for p in m.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 1000 + i)) * 1e-2)


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def ema_row(lora: bool) -> str:
    from diffusers.training_utils import EMAModel
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from runtime.train.ema import EMA

    m = model(lora)
    trained = [p for p in m.parameters() if p.requires_grad]
    ours = EMA(m, DECAY)
    torch_ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=False)
    torch_ema.update_parameters(m)  # its first call copies the weights (n_averaged 0); ours starts from them
    # min_decay = decay: a constant decay (its default warms up as (1 + step) / (10 + step))
    diffusers_ema = EMAModel(trained, decay=DECAY, min_decay=DECAY, foreach=True)
    diffusers_ema.optimization_step = 1  # its step 1 copies the weights (decay 0), as AveragedModel's first
    for step in range(UPDATES):
        nudge(m, step)
        ours.update()
        torch_ema.update_parameters(m)
        diffusers_ema.step(trained)
    ours_values = [ours.get_buffer(n.replace(".", "/")) for n, p in m.named_parameters() if p.requires_grad]
    averaged = torch_ema.module.parameters()
    torch_values = [p for p, q in zip(averaged, m.parameters(), strict=True) if q.requires_grad]

    def gap(values):
        return max((a - b).abs().max().item() for a, b in zip(values, ours_values, strict=True))

    return (
        f"EMA {'LoRA' if lora else 'full'} ({sum(p.numel() for p in trained) / 1e6:.2f}M trained of "
        f"{sum(p.numel() for p in m.parameters()) / 1e6:.1f}M):\n"
        f"  ours            {bytes_of(ours.buffers()) / 2**20:8.1f} MiB  {median_ms(ours.update):7.2f} ms/update\n"
        f"  AveragedModel   {bytes_of(torch_ema.parameters()) / 2**20:8.1f} MiB  "
        f"{median_ms(lambda: torch_ema.update_parameters(m)):7.2f} ms/update  max |diff| {gap(torch_values):.1e}\n"
        f"  diffusers EMA   {bytes_of(diffusers_ema.shadow_params) / 2**20:8.1f} MiB  "
        f"{median_ms(lambda: diffusers_ema.step(trained)):7.2f} ms/update  "
        f"max |diff| {gap(diffusers_ema.shadow_params):.1e}"
    )


def data_rows() -> None:
    from runtime.data.sampler import Order
    from runtime.data.text.packing import TextPackedLoader
    from runtime.data.text.tokenization import TokenizedSample

    rng = random.Random(0)
    samples = []
    for _ in range(20_000):
        ids = tuple(rng.randrange(500) for _ in range(rng.randrange(20, 900)))
        samples.append(TokenizedSample(ids, ids))
    loader = TextPackedLoader(samples, 1024, Order(seed=0))
    half = loader.steps_in_epoch(0) // 2
    for _ in range(half):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader)["input_ids"] for _ in range(3)]
    start = time.perf_counter()
    resumed = TextPackedLoader(samples, 1024, Order(seed=0))
    resumed.load_state_dict(state)
    got = [next(resumed)["input_ids"] for _ in range(3)]
    ours_ms = (time.perf_counter() - start) * 1e3
    same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    rows = median_ms(lambda: next(loader), repeats=200)
    print(
        f"data state (20,000 documents, {loader.steps_in_epoch(0)} rows per epoch, resume at row {half}):\n"
        f"  ours: {len(pickle.dumps(state))} bytes, resume + 3 rows {ours_ms:.0f} ms (loader built anew), same rows: "
        f"{same}; packing one row {rows:.3f} ms in process"
    )
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        print("  torchdata not installed: StatefulDataLoader not measured (pip install torchdata)")
        return

    def stateful(sampler_state=None):
        fresh = TextPackedLoader(samples, 1024, Order(seed=0))
        dl = StatefulDataLoader(
            fresh.samples, batch_sampler=fresh.sampler, collate_fn=fresh.pack, num_workers=0, persistent_workers=False
        )
        if sampler_state is not None:
            dl.load_state_dict(sampler_state)
        return dl

    dl = stateful()
    it = iter(dl)
    for _ in range(half):
        next(it)
    saved = dl.state_dict()
    expected = [next(it)["input_ids"] for _ in range(3)]
    start = time.perf_counter()
    it = iter(stateful(saved))
    got = [next(it)["input_ids"] for _ in range(3)]
    ms = (time.perf_counter() - start) * 1e3
    same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    print(
        f"  StatefulDataLoader over our sampler (batch_sampler) and packing (collate_fn): {len(pickle.dumps(saved))} "
        f"bytes, resume + 3 rows {ms:.0f} ms, same rows: {same}; keys {sorted(saved)}"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    for lora in (False, True):
        print(ema_row(lora))
    data_rows()
