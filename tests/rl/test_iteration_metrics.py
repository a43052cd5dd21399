"""The metrics verl-omni users read, against float64 re-derivations: the clip fraction split into its high and low
sides (verl's pg_clipfrac / pg_clipfrac_lower), the ratio's spread, the share of zero-std groups, and the
throughput per process; and that an iteration reports them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.rl.algorithms.objectives import ratio_stats, zero_std_ratio
from tests.rl.common import rl_config, tiny_run


def test_ratio_stats_are_the_float64_definitions():
    g = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(64, generator=g, dtype=torch.float64) * 2e-4
    clip = 1e-4
    got = ratio_stats(log_ratio.exp(), clip)
    r = np.exp(log_ratio.numpy())
    assert got["clip_fraction_high"].item() == pytest.approx(np.mean(r > 1 + clip), abs=0)
    assert got["clip_fraction_low"].item() == pytest.approx(np.mean(r < 1 - clip), abs=0)
    assert got["ratio_std"].item() == pytest.approx(np.std(r), rel=1e-12)
    assert 0 < got["clip_fraction_high"] < 1 and 0 < got["clip_fraction_low"] < 1  # both sides seen here


def test_zero_std_ratio_counts_the_groups_with_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.5, 0.7, 2.0, 2.0, 3.0, 3.0])
    group_ids = torch.arange(8) // 2
    assert zero_std_ratio(rewards, group_ids) == 3 / 4
    assert zero_std_ratio(torch.tensor([0.1, 0.2]), torch.tensor([0, 0])) == 0.0


def test_an_iteration_reports_them(tiny_pipelines, tmp_path: Path):
    metrics, _ = tiny_run(rl_config("flux", tiny_pipelines("flux"), tmp_path))
    for m in metrics:
        assert m["clip_fraction_high"] + m["clip_fraction_low"] == pytest.approx(m["clip_fraction"], abs=1e-12)
        assert m["ratio_std"] >= 0 and 0 <= m["zero_std_ratio"] <= 1 and m["samples_per_second_per_gpu"] > 0


def test_the_console_line_keeps_significant_digits_of_a_small_gradient_norm():
    """DiffusionNFT's gradient norms are about 1e-4: fixed decimals printed them as ``grad 0.000``."""
    from runtime.rl.metrics import console_fields

    line = console_fields({"policy_loss": 0.25, "grad_norm": 1.234e-4})
    assert "grad 0.000123" in line and "grad 0.000 " not in line + " "
    assert "grad 1.23" in console_fields({"grad_norm": 1.234})
