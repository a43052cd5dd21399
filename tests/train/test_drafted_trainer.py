"""The real trainer on models the project does not ship, each drafted with no hand edit and generated into a scratch
package (``tests.engine.drafted``): at sp=2 (Ulysses) every step's loss and gradient norm equal one process's within
the rounding model (``tests.tolerance``). Dense: olmo2 (q/k norms over all heads), glm4 (partial rotary, extra norms),
mistral (a sliding window), gemma2 (alternating windows, softcaps, tied embeddings); MoE: olmoe (a load-balancing
loss, q/k norms), deepseek_v3 (latent attention, grouped routing, a leading dense layer), mixtral, ernie4_5_moe;
DiTs: ChronoEdit (Wan's forward inputs, so draft gave it Wan's condition model; a tiny Wan pipeline around the
drafted tiny transformer, real MP4 clips), Bria (no `_cp_plan`: split as its forward lays the tokens out; Flux's
condition model, a tiny Flux pipeline, PNG images) and Ovis-Image (no `_cp_plan`; its own condition model,
``runtime/diffusion/conditions/ovis_image.py``). Every run passes the start-up self-check at sp=2 with its
planted defects detected (mistral, gemma2, mixtral and ernie4_5_moe, whose bos and eos ids are 1 and 2, once drew
every proof token as id 1: no planted defect could show). All eleven train in one spawned pair of ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed, start_reordered
from tests.engine.drafted import DraftedModel, drafted_installed, generate_drafted
from tests.train.common import assert_steps_match, run_config, witness_config
from tests.train.dit_common import FLUX_BUCKETS, WAN_BUCKETS, train_in_process

LMS = ["olmo2", "glm4", "mistral", "gemma2", "olmoe", "deepseek_v3", "mixtral", "ernie4_5_moe"]
DITS = ["ChronoEditTransformer3DModel", "BriaTransformer2DModel", "OvisImageTransformer2DModel"]
STEPS = 3


def _lm_run(root: Path, model_type: str) -> dict:
    from runtime.models.registry import lookup
    from runtime.models.tiny_configs import tiny_config_dict

    entry = lookup(model_type)
    model = {
        "type": model_type,
        "config": {**tiny_config_dict(model_type), "vocab_size": 512, "max_position_embeddings": 512},
        "attn_implementation": entry.data.get("attn_implementation", "sdpa"),
    }
    if entry.supports.ep:
        model["experts_implementation"] = "patchgen_grouped"
    return run_config(root, model=model, train={"steps": STEPS}, log={"dir": str(root / "log" / model_type)})


def _dit_run(root: Path, model_type: str) -> dict:
    """A tiny pipeline of the DiT's condition model around its drafted tiny config, trained on video clips (a video
    condition model) or images."""
    from runtime.data.dit.synthetic import write_synthetic_clips, write_synthetic_images
    from runtime.diffusion.conditions import condition_model_class
    from runtime.diffusion.registry import lookup_dit
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    if condition_model_class(lookup_dit(model_type).data["condition_model_type"]).video:
        data, buckets = root / "clips" / "data.jsonl", WAN_BUCKETS
        if not data.exists():
            data = write_synthetic_clips(root / "clips", 8, 9, 32, 32, seed=0, frame_folders_every=3)
    else:
        data, buckets = root / "images" / "data.jsonl", FLUX_BUCKETS[:1]
        if not data.exists():
            data = write_synthetic_images(root / "images", 8, 32, 48, seed=1)
    return {
        "model": {"type": model_type, "path": str(save_tiny_pipeline(model_type, root / model_type)), "seed": 0},
        "data": {"path": str(data), "buckets": [list(b) for b in buckets], "cache": str(root / "cache" / model_type)},
        "optim": {"lr": 2e-3, "warmup_steps": 1},
        "train": {"steps": STEPS},
        "log": {"dir": str(root / "log" / model_type), "progress": False},
    }


def drafted_worker(rank: int, world_size: int, root: str, models: list[DraftedModel], runs: list[dict]) -> list:
    """Each run trained in turn with the drafted models importable and registered: its per-step metrics."""
    import dataclasses

    with drafted_installed(Path(root), models):
        return [[dataclasses.asdict(m) for m in train_in_process(raw).metrics] for raw in runs]


@pytest.mark.dist
def test_drafted_models_train_at_sp2_as_in_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)  # tiny models on shared cores: threads cost wall time and change no result
    models = [generate_drafted(argument, tmp_path) for argument in LMS + DITS]
    with drafted_installed(tmp_path, models):
        runs = [_lm_run(tmp_path, m.model_type) for m in models[: len(LMS)]]
        runs += [_dit_run(tmp_path, m.model_type) for m in models[len(LMS) :]]
        pending = start_reordered(drafted_worker, str(tmp_path), models, [witness_config(r) for r in runs])
        reference = drafted_worker(0, 1, str(tmp_path), models, runs)
        witness = pending()
    sp2 = [{**raw, "parallel": {"sp": 2}} for raw in runs]
    per_rank = run_distributed(drafted_worker, 2, str(tmp_path), models, sp2, timeout=300)
    for model, ref, wit, *ranks in zip(models, reference, witness, *per_rank, strict=True):
        assert [m["step"] for m in ref] == list(range(1, STEPS + 1)), model.argument
        for got in ranks:
            assert_steps_match(got, ref, wit, f"drafted {model.argument} sp=2")
