"""The shipped real configs build the generated models with exactly the released checkpoints' parameter counts.

A hand-copied number that is wrong (a layer count, an intermediate size, a vocabulary) changes the count, so this
checks the configs and the generated models' shapes together against the checkpoints, not the files against
themselves. Counts: tensors' elements in the released safetensors, from public sources (docs/performance.md, plan
section): keras-hub's presets (Qwen3-8B, Qwen3-30B-A3B), a published weight listing of Qwen3-VL-30B-A3B-Instruct,
catalogs of FLUX.1-dev, Qwen-Image(-2512, the same transformer) and Lumina-Image-2.0, and the element count of
Wan2.2-T2V-A14B's experts (each the Wan2.1-T2V-14B transformer). The Omni thinker has no published count of its
own (the released checkpoint adds the talker and code2wav). Built on the meta device: no memory, about a second each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.plan.config import read_plan
from runtime.plan.footprint import build_model

CONFIGS = Path(__file__).resolve().parents[2] / "runtime" / "plan" / "configs"
RELEASED = {
    "qwen3-8b.yaml": 8_190_735_360,
    "qwen3-30b-a3b.yaml": 30_532_122_624,
    "qwen3-vl-30b-a3b.yaml": 31_070_754_032,
    "flux.1-dev.yaml": 11_901_408_320,
    "qwen-image.yaml": 20_430_401_088,
    "wan2.1-t2v-14b.yaml": 14_288_491_584,
    "lumina-image-2.0.yaml": 2_609_769_152,
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_real_config_has_the_released_parameter_count(name: str) -> None:
    plan = read_plan(CONFIGS / name)
    with torch.device("meta"):
        model = build_model(plan)
    assert sum(p.numel() for p in model.parameters()) == RELEASED[name]
