"""``runtime.plan.host_reads``: a module whose forward reads tensor values to the host runs on real tensors inside
the planner's fake step and hands back fake outputs; its real intermediates and outputs count in the peak."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from runtime import torch_compat
from runtime.plan.footprint import _LivePeak
from runtime.plan.host_reads import run_on_host


class _Lengths(nn.Module):
    """Lumina2's rope_embedder in small: reads lengths from a mask, builds per-sample rows from a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.arange(32, dtype=torch.float32)  # a plain attribute, fake when built in the fake mode

    def forward(self, hidden: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, list[int]]:
        lengths = mask.sum(dim=1).tolist()
        rows = torch.zeros(len(lengths), max(lengths), 8)
        for i, n in enumerate(lengths):
            rows[i, :n] = self.table[:n, None]
        return hidden.flatten(1), rows, lengths


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.reads = _Lengths()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        flat, rows, lengths = self.reads(hidden, mask)
        return self.proj(rows).sum() + flat.float().sum() + sum(lengths)


def _real_mask() -> Tensor:
    with torch_compat.real_tensors():
        return torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_a_host_read_fails_on_fake_tensors_and_runs_wrapped() -> None:
    fake = torch_compat.fake_tensor_mode()
    with fake:
        model, hidden, mask = _Model(), torch.zeros(2, 3, 5), _real_mask()
    with fake, pytest.raises(Exception, match="_local_scalar_dense|data-dependent"):
        model(hidden, torch.ones(2, 4, dtype=torch.long))  # a fake mask: no values to read
    run_on_host(model, ["reads"])
    with fake:
        flat, rows, lengths = model.reads(hidden, mask)
        model(hidden, mask).backward()  # the rest of the step, fake, with its backward
    assert lengths == [3, 2] and all(isinstance(n, int) for n in lengths)
    assert torch_compat.is_fake(flat) and torch_compat.is_fake(rows)
    assert rows.shape == (2, 3, 8) and flat.shape == (2, 15) and torch_compat.is_fake(model.proj.weight.grad)


def test_outputs_and_real_intermediates_count_in_the_peak() -> None:
    fake = torch_compat.fake_tensor_mode()
    with fake:
        model, hidden, mask = _Lengths(), torch.zeros(2, 3, 5), _real_mask()
    run_on_host(model, [""])
    tracker = _LivePeak(lambda: 0)
    with fake, tracker:
        _, rows, _ = model(hidden, mask)
        live = tracker.live
    # the rows (2 x 3 x 8 fp32) are alive as a fake output; the flattened hidden (a view of an input) counts too
    assert live >= rows.numel() * 4 and tracker.peak >= 2 * rows.numel() * 4  # the real rows and their fake copy


def test_a_module_on_the_autograd_graph_is_refused() -> None:
    fake = torch_compat.fake_tensor_mode()
    with fake:
        model, mask = _Lengths(), _real_mask()
        hidden = torch.zeros(2, 3, 5, requires_grad=True)
    run_on_host(model, [""])
    with fake, pytest.raises(ValueError, match="off the autograd graph"):
        model(hidden, mask)


def test_outside_a_fake_mode_the_module_runs_as_is() -> None:
    model = _Lengths()
    run_on_host(model, [""])
    flat, rows, lengths = model(torch.ones(2, 3, 5), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    assert lengths == [3, 2] and float(rows[0, 2, 0]) == 2.0 and not torch_compat.is_fake(flat)
