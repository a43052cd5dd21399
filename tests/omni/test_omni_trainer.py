"""The trainer on the tiny qwen3_omni_moe thinker and the synthetic omni data (audio clips at three sampling rates,
images, a video with its audio track): SP=2 and EP=2 against one process step by step; frozen audio encoder; the export
loads in plain transformers with identical logits; configuration errors of the omni options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config.errors import ConfigError
from runtime.train.config import parse_config
from tests.dist_utils import run_distributed
from tests.omni.trainer_common import omni_run_config
from tests.train.common import assert_steps_match, one_process_steps, run_config, train_worker


@pytest.mark.dist
def test_omni_sp2_matches_sp1_every_step(tmp_path: Path) -> None:
    """The load-balancing term is on (the tiny config's coefficient): SP pads the row, and the padding is masked out
    of the load-balancing loss, so both runs see the same real tokens."""
    raw = omni_run_config(tmp_path, aux_loss_coef=0.05)
    reference, witness = one_process_steps(raw)
    per_rank = run_distributed(train_worker, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert len(reference) == 3
    for rank_metrics in per_rank:
        assert_steps_match(rank_metrics[:-1], reference, witness, "omni sp2")


@pytest.mark.dist
def test_omni_ep2_matches_single_process_every_step(tmp_path: Path) -> None:
    """ep=2 on 2 ranks (grouped kernel; rows j and j+1 go to the two replicas) against one process with 2
    micro-batches (eager experts). The budget keeps one sample per row, so both layouts pack the same rows; the
    load-balancing term is off (per micro-batch in one process, global across replicas)."""
    budget = {"token_budget": 98}
    raw = omni_run_config(tmp_path, aux_loss_coef=0.0, data=budget)
    eager = {"model": {**raw["model"], "experts_implementation": "eager"}, "train": {"steps": 3, "micro_batches": 2}}
    reference, witness = one_process_steps({**raw, **eager})
    per_rank = run_distributed(train_worker, 2, {**raw, "parallel": {"ep": 2}}, timeout=300)
    assert len(reference) == 3
    assert_steps_match(per_rank[0][:-1], reference, witness, "omni ep2", tokens=False)


def test_freeze_audio_and_export_loads_in_plain_transformers(tmp_path: Path) -> None:
    import transformers

    from runtime.data.audio.packing import pack_omni_row
    from runtime.data.audio.processor import load_omni_processor, omni_token_ids
    from runtime.data.audio.tokenization import tokenize_omni
    from runtime.data.samples import read_jsonl
    from runtime.train.model import build_model

    raw = omni_run_config(
        tmp_path, model={"freeze_audio": True}, train={"steps": 2}, export={"dir": str(tmp_path / "hf")}
    )
    train_worker(0, 1, raw)
    config = parse_config(raw)
    processor = load_omni_processor(config.data.processor)
    initial = build_model(config.model, omni_token_ids(processor)).state_dict()
    # eager experts on both sides: the numerical reference (the training kernel differs in the last bits)
    exported = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, experts_implementation="eager"
    )
    assert type(exported).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert type(exported).__module__.startswith("transformers.")
    state = exported.state_dict()
    assert state.keys() == initial.keys()
    audio = [k for k in initial if k.startswith("audio_tower.")]
    assert audio and all(torch.equal(state[k], initial[k]) for k in audio)
    for key in ("visual.blocks.0.mlp.linear_fc1.weight", "model.layers.0.mlp.gate.weight"):
        assert not torch.equal(state[key], initial[key]), key
    # the generated class and plain transformers compute the same logits from the export
    reload = {**raw["model"], "path": str(tmp_path / "hf"), "experts_implementation": "eager"}
    reload.pop("config")  # the checkpoint's config.json is used
    generated = build_model(parse_config({**raw, "model": reload}).model)
    samples = read_jsonl(config.data.path)
    fn = type(generated).get_position_id_func(generated.config)
    row = pack_omni_row([tokenize_omni(s, processor, fn, generated.config) for s in samples[2:4]], 512)
    with torch.no_grad():
        # a packed row: no KV cache on either side (the export's config turns it on, as upstream's does, and a cache
        # would make upstream ignore the packed documents' boundaries)
        ref = exported(**row, use_cache=False).logits
        got = generated(**row, use_cache=False).logits
    assert torch.equal(ref, got)
    assert omni_token_ids(load_omni_processor(tmp_path / "hf")) == omni_token_ids(processor)


def test_omni_config_errors(tmp_path: Path) -> None:
    raw = run_config(tmp_path, model={"freeze_audio": True})
    with pytest.raises(ConfigError, match="model.freeze_audio: 'qwen3' has no audio encoder"):
        parse_config(raw)
    raw = omni_run_config(tmp_path)
    raw["data"].pop("processor")
    with pytest.raises(ConfigError, match="data.processor: required"):
        parse_config(raw)
