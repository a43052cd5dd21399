"""``runtime/parallel/halo.py`` at 2 gloo ranks (the pooled world size) against one process: a 3x3 depthwise conv
(Sana's ``GLUMBConv.conv_depth``) and a 5x5 dense one over a grid whose 5 rows are split over the ranks (uneven: the
last block ends in a padding row holding garbage, masked), output rows and the gradients of the input and of the
conv's weight and bias. Each output element sums the same products as one process but in another order (the halo
rows are concatenated, not padded): held to 1e-6 relative in float64."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

ROWS, COLS = 5, 6
CONVS = {"depthwise3": dict(kernel_size=3, padding=1, groups=4), "dense5": dict(kernel_size=5, padding=2)}


def _setup(name: str) -> tuple[torch.nn.Conv2d, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, **CONVS[name]).double()
    x = torch.randn(2, 4, ROWS, COLS, dtype=torch.float64)
    return conv, x, torch.randn(2, 4, ROWS, COLS, dtype=torch.float64)


def _reference(name: str) -> dict:
    conv, x, target = _setup(name)
    x.requires_grad_(True)
    out = conv(x)
    (out * target).sum().backward()
    return {"out": out.detach(), "x": x.grad, "weight": conv.weight.grad, "bias": conv.bias.grad}


def halo_worker(rank: int, world: int, names: list[str]) -> list[dict]:
    import torch.distributed as dist

    from runtime.parallel.halo import halo_conv2d

    results = []
    for name in names:
        conv, x, target = _setup(name)
        local = -(-ROWS // world)
        pad = local * world - ROWS
        padded = torch.cat([x, x.new_full((2, 4, pad, COLS), 7.0)], 2)  # padding rows hold garbage: masked
        mine = padded[:, :, rank * local : (rank + 1) * local].clone().requires_grad_(True)
        valid = max(0, min(local, ROWS - rank * local))
        out = halo_conv2d(conv, mine, valid, dist.group.WORLD)
        t = torch.cat([target, target.new_zeros(2, 4, pad, COLS)], 2)[:, :, rank * local : (rank + 1) * local]
        (out * t).sum().backward()
        for p in conv.parameters():
            dist.all_reduce(p.grad)
        results.append({"out": out.detach()[:, :, :valid], "x": mine.grad[:, :, :valid], "weight": conv.weight.grad,
                        "bias": conv.bias.grad})  # fmt: skip
    return results


@pytest.mark.dist
def test_halo_conv_matches_one_process(world: int = 2) -> None:
    names = sorted(CONVS)
    per_rank = run_distributed(halo_worker, world, names, timeout=300)
    for index, name in enumerate(names):
        ref = _reference(name)
        for key in ("out", "x"):
            got = torch.cat([rank[index][key] for rank in per_rank], 2)
            assert torch.allclose(got, ref[key], rtol=1e-6, atol=1e-12), (name, key)
        for key in ("weight", "bias"):
            for rank in per_rank:
                assert torch.allclose(rank[index][key], ref[key], rtol=1e-6, atol=1e-12), (name, key)


def test_without_a_group_it_is_the_conv() -> None:
    from runtime.parallel.halo import halo_conv2d

    conv, x, _ = _setup("depthwise3")
    assert torch.equal(halo_conv2d(conv, x, ROWS, None), conv(x))
