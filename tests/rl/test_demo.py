"""The FlowGRPO demo's config is a valid ``runtime.rl`` config of what the demo says it runs (sp=2, two rewards, a
checkpoint to resume from, an export), and its reward is importable by the path the config names. The demo itself
(two torchrun launches) runs in ``make demo``."""

from pathlib import Path

import torch

from runtime.demos.flowgrpo import FIRST, TOTAL, brightness, config
from runtime.rl.config import parse_rl_config
from runtime.rl.rewards import build_rewards


def test_demo_config_is_valid_and_says_what_the_demo_runs(tmp_path: Path) -> None:
    (tmp_path / "clip").mkdir()  # the demo writes its tiny CLIP there first: the config checks that it exists
    raw = config(tmp_path, tmp_path / "flux", tmp_path / "clip", TOTAL)
    parsed = parse_rl_config(raw)
    assert parsed.parallel.sp == 2 and parsed.checkpoint.interval == FIRST < TOTAL and parsed.export.dir
    assert [r.get("name") for r in parsed.rewards] == ["brightness", "clip"]
    mix = build_rewards(parsed.rewards[:1])
    x = torch.rand(2, 3, 8, 8) * 2 - 1
    torch.testing.assert_close(mix(x, ["a", "b"])[0], brightness(x, ["a", "b"]))
