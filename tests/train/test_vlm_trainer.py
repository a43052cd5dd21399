"""The VLM trainer (the text trainer with a processor, multimodal rows and vision options) on tiny qwen3_vl:
SP=2 against one process step by step, FSDP with a rank whose row holds no image, frozen vision tower, export,
and the configuration errors specific to VLMs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config.errors import ConfigError
from runtime.train.config import parse_config
from tests.dist_utils import run_distributed
from tests.train.common import assert_steps_match, one_process_steps, run_config, train_worker
from tests.train.vlm_common import vlm_run_config


@pytest.mark.dist
@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen2_5_vl"])
def test_vlm_sp2_matches_sp1_every_step(tmp_path: Path, model_type: str) -> None:
    reference, witness = one_process_steps(vlm_run_config(tmp_path, model_type))
    per_rank = run_distributed(train_worker, 2, vlm_run_config(tmp_path, model_type, parallel={"sp": 2}), timeout=300)
    assert len(reference) == 3
    for rank_metrics in per_rank:
        assert_steps_match(rank_metrics[:-1], reference, witness, model_type)


@pytest.mark.dist
def test_vlm_moe_ep2_matches_single_process_every_step(tmp_path: Path) -> None:
    """qwen3_vl_moe, 3 steps: ep=2 on 2 ranks (grouped kernel; rows j and j+1 go to the two replicas) against one
    process with 2 micro-batches (eager experts). The load-balancing term is left out, as in the text MoE test:
    over micro-batches it is per row, across replicas global (tests/parity/test_vlm_moe_ep.py checks that one)."""
    raw = vlm_run_config(tmp_path, "qwen3_vl_moe")
    raw["model"]["config"]["text_config"]["router_aux_loss_coef"] = 0.0
    eager = {"model": {**raw["model"], "experts_implementation": "eager"}, "train": {"steps": 3, "micro_batches": 2}}
    reference, witness = one_process_steps({**raw, **eager})
    per_rank = run_distributed(train_worker, 2, {**raw, "parallel": {"ep": 2}}, timeout=300)
    assert_steps_match(per_rank[0][:-1], reference, witness, "qwen3_vl_moe ep2", tokens=False)


def _image_presence(raw: dict, dp_size: int, steps: int) -> list[list[bool]]:
    """Per step, per DP rank: whether that rank's row holds an image (what the trainer's loaders will yield)."""
    from runtime.data.sampler import Order
    from runtime.data.samples import read_samples_located
    from runtime.data.vision.packing import MultimodalPackedLoader
    from runtime.data.vision.processor import load_processor, vlm_token_ids
    from runtime.data.vision.tokenization import tokenize_multimodal
    from runtime.train.model import build_model

    config = parse_config(raw)
    processor = load_processor(config.data.processor)
    model = build_model(config.model, vlm_token_ids(processor))
    fn = type(model).get_position_id_func(model.config)
    samples = [tokenize_multimodal(s.sample, processor, fn) for s in read_samples_located(config.data.path)]
    loaders = [
        MultimodalPackedLoader(samples, config.data.token_budget, Order(config.data.seed, dp_rank=r, dp_size=dp_size))
        for r in range(dp_size)
    ]
    return [["pixel_values" in next(loader) for loader in loaders] for _ in range(steps)]


@pytest.mark.dist
def test_vlm_fsdp_with_a_text_only_rank(tmp_path: Path) -> None:
    raw = vlm_run_config(tmp_path, text_only=24, train={"steps": 4}, data={"token_budget": 48})
    presence = _image_presence(raw, 2, 4)
    assert any(len(set(step)) == 2 for step in presence), presence  # some step: one rank with, one without images
    metrics = run_distributed(train_worker, 2, raw, timeout=300)
    agreed = [[(m["step"], m["loss"], m["grad_norm"], m["tokens"]) for m in rank[:-1]] for rank in metrics]
    assert len(agreed[0]) == 4 and agreed[0] == agreed[1]  # both ranks ran every step and agree on the global loss
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics[0][:-1])


def test_freeze_vision_keeps_the_vit_and_exports(tmp_path: Path) -> None:
    import transformers

    from runtime.data.vision.processor import load_processor, vlm_token_ids
    from runtime.train.model import build_model

    raw = vlm_run_config(
        tmp_path, model={"freeze_vision": True}, train={"steps": 2}, export={"dir": str(tmp_path / "hf")}
    )
    run_distributed(train_worker, 1, raw, timeout=300)
    config = parse_config(raw)
    initial = build_model(config.model, vlm_token_ids(load_processor(config.data.processor))).state_dict()
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").state_dict()
    assert exported.keys() == initial.keys()
    vision = [k for k in initial if k.startswith("model.visual.")]
    assert vision and all(torch.equal(exported[k], initial[k]) for k in vision)
    assert not torch.equal(
        exported["model.language_model.layers.0.mlp.up_proj.weight"],
        initial["model.language_model.layers.0.mlp.up_proj.weight"],
    )
    assert vlm_token_ids(load_processor(tmp_path / "hf")) == vlm_token_ids(load_processor(config.data.processor))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw: raw["data"].pop("processor"), "data.processor: required for the vision-language model"),
        (lambda raw: raw["data"].update(tokenizer="tok/"), "data.tokenizer: a vision-language model reads"),
    ],
)
def test_vlm_config_errors(tmp_path: Path, mutate, message: str) -> None:
    raw = vlm_run_config(tmp_path)
    mutate(raw)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_text_model_rejects_vision_options(tmp_path: Path) -> None:
    raw = run_config(tmp_path, model={"freeze_vision": True})
    with pytest.raises(ConfigError, match="model.freeze_vision: 'qwen3' has no vision tower"):
        parse_config(raw)
    raw = run_config(tmp_path, data={"processor": "proc/"})
    with pytest.raises(ConfigError, match="data.processor: only vision-language models"):
        parse_config(raw)
    assert parse_config(run_config(tmp_path)).data.processor is None  # the plain text config stays valid


def test_the_trainer_adds_the_moe_load_balancing_loss(tmp_path: Path) -> None:
    """qwen3_vl_moe computes router logits only when asked in the forward call: the trainer must ask (the step loss
    is then LM loss + coef * aux), whatever the config's output_router_logits says."""
    raw = vlm_run_config(tmp_path, "qwen3_vl_moe", train={"steps": 1})
    losses = {}
    for coef in (0.0, 0.5):
        raw["model"]["config"]["text_config"]["router_aux_loss_coef"] = coef
        losses[coef] = run_distributed(train_worker, 1, raw, timeout=300)[0][0]["loss"]
    assert losses[0.5] > losses[0.0] + 0.1, losses  # the aux loss of a tiny MoE with 8 experts is ~1 (>= 1)
