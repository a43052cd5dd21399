"""A pipeline with two transformers switched at ``boundary_ratio`` (Wan2.2 A14B: ``transformer`` denoises
``timestep >= boundary_ratio * 1000``, ``transformer_2`` the rest) in the DiT trainer, on a tiny random
``WanPipeline`` with both experts:

* ``dit.condition.expert`` chooses the trained expert; its noise levels are drawn in its range only, so every
  sample's loss goes to the expert the pipeline runs at that timestep; unset on such a pipeline: refused in one line
  (both in one job is not supported: the experts share no parameters, one job per expert trains them);
* sp=2 against one process (loss and grad norm per step within the rounding model, tests.tolerance);
* the export is the whole pipeline, the trained expert in its folder and the other copied, that plain
  ``WanPipeline.from_pretrained`` loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed, start_reordered
from tests.tolerance import assert_steps_within_rounding
from tests.train.dit_common import WAN_BUCKETS, per_step, train_in_process, witness_steps

BOUNDARY = 0.875  # Wan2.2-T2V-A14B's boundary_ratio


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffusers import WanPipeline

    from runtime.data.dit.synthetic import write_synthetic_clips
    from runtime.diffusion.conditions.wan import WanConditionModel
    from runtime.diffusion.registry import lookup_dit, tiny_config

    root = tmp_path_factory.mktemp("dit_experts")
    config = tiny_config("wan")
    torch.manual_seed(0)
    components = WanConditionModel.tiny_components(config, None)
    upstream = lookup_dit("wan").upstream_class()
    components["transformer"], components["transformer_2"] = upstream(**config), upstream(**config)
    WanPipeline(**components, boundary_ratio=BOUNDARY).save_pretrained(root / "a14b")
    clips = write_synthetic_clips(root / "clips", 4, 9, 32, 32, seed=0, frame_folders_every=2)
    return {"a14b": root / "a14b", "clips": clips, "root": root}


def _config(files: dict[str, Path], work: Path, expert: str | None, **sections) -> dict:
    raw = {
        "model": {"type": "wan", "path": str(files["a14b"]), "seed": 0},
        "data": {"path": str(files["clips"]), "buckets": WAN_BUCKETS, "cache": str(files["root"] / "cache")},
        "dit": {"condition": {} if expert is None else {"expert": expert}},
        "optim": {"lr": 2e-3},
        "train": {"steps": 2},
        "log": {"dir": str(work / "log"), "progress": False},
    }
    raw.update(sections)
    return raw


def _train_all(rank: int, world_size: int, configs: list[dict]) -> list[list[tuple[float, float]]]:
    return [per_step(train_in_process(raw)) for raw in configs]


def test_the_expert_is_chosen_and_its_noise_levels_only(files: dict[str, Path], tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.diffusion.conditions import load_condition_model

    with pytest.raises(ConfigError, match=r"dit\.condition\.expert: .* two transformers .* boundary_ratio 0\.875"):
        train_in_process(_config(files, tmp_path / "none", None))
    for expert, inside in (("transformer", lambda s: s >= BOUNDARY), ("transformer_2", lambda s: s < BOUNDARY)):
        cm = load_condition_model("wan", files["a14b"], encoders=False, expert=expert)
        sigmas = cm.sampler.sample(4000, 0, torch.Generator().manual_seed(0))
        assert inside(sigmas).all() and inside(sigmas * 1000 / 1000).all(), expert


@pytest.mark.dist
def test_one_expert_trains_at_sp2_and_exports_a_pipeline_plain_diffusers_loads(
    files: dict[str, Path], tmp_path: Path
) -> None:
    from diffusers import WanPipeline

    export = {"dir": str(tmp_path / "export")}
    raw = _config(files, tmp_path / "ref", "transformer_2", export=export)
    pending = start_reordered(witness_steps, [raw])  # the rounding model's witness, alongside (tests.tolerance)
    result = train_in_process(raw)
    ref, witness = per_step(result), pending()[0]
    sp = [_config(files, tmp_path / "sp", "transformer_2", parallel={"sp": 2})]
    got = run_distributed(_train_all, 2, sp, timeout=600)[0][0]
    assert_steps_within_rounding(got, ref, witness, "transformer_2 sp2")

    source = WanPipeline.from_pretrained(files["a14b"])
    loaded = WanPipeline.from_pretrained(export["dir"])
    assert loaded.config.boundary_ratio == BOUNDARY
    trained = result.model.state_dict()
    for name, value in loaded.transformer_2.state_dict().items():  # the trained expert
        assert torch.equal(value, trained[name]), name
    assert any(not torch.equal(v, source.transformer_2.state_dict()[n]) for n, v in trained.items())
    for name, value in loaded.transformer.state_dict().items():  # the other, copied as it was
        assert torch.equal(value, source.transformer.state_dict()[name]), name
