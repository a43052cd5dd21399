"""The real trainer on models the project does not ship, each drafted with no hand edit and generated into a scratch
package (``tests.engine.drafted``): at sp=2 (Ulysses), and at ring=2 for each LM whose record claims ring, every
step's loss and gradient norm equal one process's within the rounding model (``tests.tolerance``). Dense: olmo2 (q/k
norms over all heads), glm4 (partial rotary, extra norms), mistral (a sliding window), gemma2 (alternating windows,
softcaps, tied embeddings); MoE: olmoe (a load-balancing loss, q/k norms), deepseek_v3 (latent attention, grouped
routing, a leading dense layer), mixtral, ernie4_5_moe; DiTs: ChronoEdit (Wan's forward inputs, so draft gave it
Wan's condition model; a tiny Wan pipeline around the drafted tiny transformer, real MP4 clips), Bria (no
`_cp_plan`: split as its forward lays the tokens out; Flux's condition model, a tiny Flux pipeline, PNG images) and
Ovis-Image (no `_cp_plan`; its own condition model, ``runtime/diffusion/conditions/ovis_image.py``). Every run
passes the start-up self-check at sp=2 with its planted defects detected (mistral, gemma2, mixtral and ernie4_5_moe,
whose bos and eos ids are 1 and 2, once drew every proof token as id 1: no planted defect could show). All eleven
train in one spawned pair of ranks, which then runs each DiT's transformer alone at sp=2 (output, loss and every
gradient within the rounding model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed, start_reordered
from tests.engine.drafted import DraftedModel, drafted_installed, generate_drafted
from tests.tolerance import assert_within_rounding
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


def _without_ring_refused(raw: dict, name: str) -> dict:
    """The run with the model config's options that ring attention does not honour unset (a run setting them at
    ring > 1 is refused in one line: tests/train/test_supports.py), logging to a folder of its own."""
    import transformers

    from runtime.models.supports import OPTIONS, set_options

    built = transformers.AutoConfig.for_model(raw["model"]["type"], **raw["model"]["config"]).to_dict()
    refused = {key: None for key in set_options(built) if OPTIONS[key][0] == "ring"}
    config = {**raw["model"]["config"], **refused}
    log = {**raw["log"], "dir": raw["log"]["dir"] + f"-{name}"}
    return {**raw, "model": {**raw["model"], "config": config}, "log": log}


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


def _layout_case(model: DraftedModel, checkpointing: bool) -> dict:
    """The drafted DiT's tiny transformer on its condition model's example inputs: output, loss, every gradient
    (the DiT SP suite's case, ``tests/dit/test_sp.py``); under SP the group's sum of the partial gradients."""
    import torch.distributed as dist

    from runtime.diffusion.registry import tiny_config
    from runtime.parallel.state import get_parallel_state
    from tests.dit.cases import Case, inputs, loss_and_grads, shell

    with torch.random.fork_rng(devices=[]):
        case = Case(model.model_type, model.model_type, None, tiny_config(model.model_type))
        shelled = shell(case)
        if checkpointing:
            shelled.gradient_checkpointing_enable()
            shelled.train()
        out, loss, grads = loss_and_grads(shelled, inputs(case))
    state = get_parallel_state()
    for grad in grads.values() if state.sp_enabled else ():
        if grad is not None:
            dist.all_reduce(grad, group=state.sp_group)
    return {"out": out, "loss": loss, "grads": grads}


def drafted_worker(
    rank: int, world_size: int, root: str, models: list[DraftedModel], runs: list[dict], layouts: list[tuple]
) -> tuple[list, list]:
    """Each run trained in turn with the drafted models importable and registered (its per-step metrics), then each
    (model index, checkpointing) layout case at sp = world size."""
    import dataclasses

    from runtime.parallel.state import init_parallel_state, set_parallel_state

    with drafted_installed(Path(root), models):
        steps = [[dataclasses.asdict(m) for m in train_in_process(raw).metrics] for raw in runs]
        if world_size > 1:
            init_parallel_state(sp_size=world_size)
        try:
            return steps, [_layout_case(models[index], checkpointing) for index, checkpointing in layouts]
        finally:
            set_parallel_state(None)


@pytest.mark.dist
def test_drafted_models_train_at_sp2_as_in_one_process(tmp_path: Path) -> None:
    """Every step at sp=2 as in one process; each DiT's transformer alone too (output, loss and every gradient at
    sp=2 within the rounding model, with and without gradient checkpointing), in the same spawned pair."""
    torch.set_num_threads(1)  # tiny models on shared cores: threads cost wall time and change no result
    models = [generate_drafted(argument, tmp_path) for argument in LMS + DITS]
    layouts = [(index, checkpointing) for index in range(len(LMS), len(models)) for checkpointing in (False, True)]
    with drafted_installed(tmp_path, models):
        from runtime.models.registry import lookup

        ring = [i for i, m in enumerate(models[: len(LMS)]) if lookup(m.model_type).supports.ring]
        runs = [_lm_run(tmp_path, m.model_type) for m in models[: len(LMS)]]
        runs += [_dit_run(tmp_path, m.model_type) for m in models[len(LMS) :]]
        # a record claims ring only for what ran: each drafted LM whose record claims it trains at ring=2 too, its
        # config without the options the runtime refuses under ring (runtime.models.supports.OPTIONS: gemma2's
        # attention softcap), against its own one-process run
        ring_runs = [_without_ring_refused(runs[i], f"ring-{i}") for i in ring]
        every = runs + ring_runs
        pending = start_reordered(drafted_worker, str(tmp_path), models, [witness_config(r) for r in every], layouts)
        reference, reference_layouts = drafted_worker(0, 1, str(tmp_path), models, every, layouts)
        witness, witness_layouts = pending()
    sp2 = [{**raw, "parallel": {"sp": 2}} for raw in runs]
    per_rank = run_distributed(drafted_worker, 2, str(tmp_path), models, sp2, layouts, timeout=300)
    for i, (model, ref, wit) in enumerate(zip(models, reference[: len(runs)], witness[: len(runs)], strict=True)):
        assert [m["step"] for m in ref] == list(range(1, STEPS + 1)), model.argument
        for steps, _ in per_rank:
            assert_steps_match(steps[i], ref, wit, f"drafted {model.argument} sp=2")
    assert ring, "no drafted LM claims ring"
    ring2 = [{**raw, "parallel": {"ring": 2}} for raw in ring_runs]
    for steps, _ in run_distributed(drafted_worker, 2, str(tmp_path), models, ring2, [], timeout=300):
        for k, i in enumerate(ring):
            ref, wit = reference[len(runs) + k], witness[len(runs) + k]
            assert_steps_match(steps[k], ref, wit, f"drafted {models[i].argument} ring=2")
    for k, (index, checkpointing) in enumerate(layouts):
        what = f"drafted {models[index].argument} sp=2{' checkpointing' if checkpointing else ''}"
        for _, got in per_rank:
            assert got[k]["out"].shape == reference_layouts[k]["out"].shape, what
            assert_within_rounding(got[k], reference_layouts[k], witness_layouts[k], what=what)
