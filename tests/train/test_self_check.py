"""The start-up self-check of text language models: a clean run passes and says so before step 1; planted defects
of the silent kinds (a doubled SP gradient share, a generated class that loses an option upstream honours) stop the
run naming the parameter; the shrink rule keeps the job's options and drops its big sizes and token ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from runtime.config.errors import ConfigError
from runtime.parallel.state import ParallelState
from runtime.train.self_check import untouched_rng
from runtime.train.self_check_shrink import ShrinkLayout, fit_layer_types, shrink_values
from tests.dist_utils import run_distributed
from tests.train.common import TINY_MODEL, TINY_MOE, run_config, run_main
from tests.train.self_check_defects import (
    DoubledSPLoss,
    RecurrentQwen3,
    RecurrentUpstreamQwen3,
    check_worker,
    job_config,
    train_printing_worker,
)

SKIPS = "train.self_check: {enabled: false, reason: ...} skips the check"  # the refusal's last words

QWEN3_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.dist
def test_clean_sp2_run_passes_and_says_so_before_step_1(tmp_path: Path) -> None:
    raw = run_config(tmp_path, parallel={"sp": 2}, train={"steps": 1})
    (out0, losses0), (out1, _) = run_distributed(train_printing_worker, 2, raw, timeout=300)
    lines = [line for line in out0.splitlines() if line.startswith("self-check:")]
    assert len(lines) == 1 and lines[0].startswith("self-check: passed in "), out0
    assert "dp_replicate 1 x dp_shard 1 x sp 2" in lines[0] and "generated vs upstream" in lines[0], lines[0]
    # the local first attention site and the first shard's RoPE slice, each planted and caught
    assert re.search(r"power: 2 planted defects detected, smallest margin \d+x\)$", lines[0]), lines[0]
    first_step = re.search(r"step +1/1 loss", out0)
    assert first_step and out0.index("self-check:") < first_step.start(), out0  # before step 1 is reported
    assert "self-check" not in out1  # rank 0 speaks
    assert len(losses0) == 1


@pytest.mark.dist
def test_doubled_sp_gradient_share_stops_the_run_naming_a_parameter(tmp_path: Path) -> None:
    raw = run_config(tmp_path, parallel={"sp": 2}, model={"config": TINY_MODEL})
    results = run_distributed(check_worker, 2, raw, DoubledSPLoss, {}, timeout=300)
    for _, error in results:  # every rank stops, with the same line
        assert error == results[0][1] and "\n" not in error, results
    error = results[0][1]
    assert error.startswith("train.self_check: the start-up self-check failed: "), error
    assert "its gradient differs by 1.00e+00 relative" in error and "tolerance 1e-04" in error, error  # twice: 1
    assert "dp_replicate 1 x dp_shard 1 x sp 2" in error and SKIPS in error
    assert "model." in error or "lm_head." in error, error  # a parameter is named


@pytest.mark.dist
def test_moe_ep2_with_a_job_option_passes(tmp_path: Path) -> None:
    """qwen3_moe at ep=2 x sp=2... on world 2: ep 2 (dp_shard 2), with the job's router coefficient and biases."""
    moe = {"type": "qwen3_moe", "config": TINY_MOE}
    raw = run_config(tmp_path, parallel={"ep": 2}, model=moe)
    results = run_distributed(check_worker, 2, raw, None, {"attention_bias": True}, timeout=300)
    out, error = results[0]
    assert error == "" and out.startswith("self-check: passed in "), results
    assert "dp_replicate 1 x dp_shard 2 x sp 1, ep 2" in out and "experts" in out, out
    assert "power: 1 planted defect detected" in out, out  # the doubled replica share


@pytest.mark.dist
@pytest.mark.parametrize(
    ("model_type", "parallel"), [("qwen3_vl", {"dp_shard": 2}), ("qwen3_omni_moe_thinker", {"sp": 2})]
)
def test_vision_language_and_omni_jobs_pass(tmp_path: Path, model_type: str, parallel: dict) -> None:
    """qwen3_vl at dp_shard 2: replica 0's row holds an image (ViT, fill-back, deepstack), replica 1's none (the
    tower's dummy forward); the omni thinker on text-only rows at sp 2. The job's config is the transformers default
    (real sizes, a text config that would keep a KV cache), shrunk."""
    raw = run_config(tmp_path, model={"type": model_type, "config": {}}, parallel=parallel)
    raw["data"] = {**raw["data"], "processor": str(tmp_path / "processor"), "tokenizer": None}
    results = run_distributed(check_worker, 2, raw, None, {}, timeout=300)
    out, error = results[0]
    assert error == "" and out.startswith("self-check: passed in ") and "vision depth" in out, results
    assert "AutoModelForImageTextToText" in out and "x dp_shard" in out, out


@pytest.mark.dist
def test_hsdp_sp_ep_in_bf16_passes_at_world_4(tmp_path: Path) -> None:
    """qwen3_moe on dp_replicate 2 x sp 2 with ep 2 in bf16: HSDP, Ulysses, experts over the SP ranks, bf16
    parameters against the fp32 reference (tolerance 0.25, runtime/train/self_check.py)."""
    parallel = {"dp_replicate": 2, "sp": 2, "ep": 2}
    raw = run_config(tmp_path, model={"type": "qwen3_moe", "config": TINY_MOE}, parallel=parallel)
    raw["train"] = {**raw["train"], "mixed_precision": "bf16"}
    results = run_distributed(check_worker, 4, raw, None, {}, timeout=400)
    out, error = results[0]
    assert error == "" and out.startswith("self-check: passed in "), results
    assert "dp_replicate 2 x dp_shard 1 x sp 2, ep 2, bfloat16" in out and "tolerance 1e-04, 0.25" in out, out


def test_generated_class_that_loses_the_window_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated module builds the sliding-window layers' mask as a plain causal mask (what a patch that lost
    the window would do); upstream keeps it. The job sets a window (4096, capped to the proof's documents)."""
    import generated.qwen3.modeling_qwen3 as gen
    from runtime.train.config import parse_config
    from runtime.train.self_check_job import self_check

    monkeypatch.setattr(gen, "create_sliding_window_causal_mask", gen.create_causal_mask)
    config = parse_config(run_config(tmp_path))
    values = {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}
    layers = {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"], "num_hidden_layers": 3}
    model = type("Job", (), {"config": job_config("qwen3", **values, **layers)})
    with pytest.raises(ConfigError) as caught:
        self_check(config, ParallelState(), model)
    message = str(caught.value)
    assert "generated vs upstream AutoModelForCausalLM" in message and SKIPS in message, message
    assert "gradient differs by" in message or "the loss differs by" in message, message


def test_a_mismatch_exits_2_with_one_line_before_step_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``python -m runtime.train``: the lost window (as above) on a job whose second layer slides stops the
    run with exit code 2 and one line naming the key that turns the check off; no step ran."""
    import generated.qwen3.modeling_qwen3 as gen

    monkeypatch.setattr(gen, "create_sliding_window_causal_mask", gen.create_causal_mask)
    window = {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]}
    raw = run_config(tmp_path, model={"config": {**TINY_MODEL, **window}})
    code, stderr = run_main(raw, tmp_path)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr)
    assert "train.self_check: the start-up self-check failed: " in lines[0], lines
    assert "generated vs upstream" in lines[0] and SKIPS in lines[0], lines
    assert not (tmp_path / "log" / "metrics.jsonl").exists()  # before step 1


def test_the_shrunk_model_keeps_the_jobs_options() -> None:
    """The proof's model computes with the job's biases, rope theta and activation, at the tiny sizes."""
    from runtime.models.registry import causal_lm_class
    from runtime.train.self_check_text import shrunk_text_config

    job = job_config("qwen3", attention_bias=True, rope_theta=5e5, hidden_act="gelu", eos_token_id=151645)
    shrunk = shrunk_text_config(job, ParallelState())
    assert (
        shrunk.attention_bias is True and shrunk.rope_parameters["rope_theta"] == 5e5 and shrunk.hidden_act == "gelu"
    )
    assert shrunk.hidden_size == 64 and shrunk.vocab_size == 97 and shrunk.eos_token_id is None
    model = causal_lm_class("qwen3")(shrunk)
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_clean_single_process_check_passes_and_can_be_turned_off(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from runtime.train.config import parse_config
    from runtime.train.self_check_job import self_check

    model = type("Job", (), {"config": job_config("qwen3", attention_bias=True, rope_theta=5e5)})
    self_check(parse_config(run_config(tmp_path)), ParallelState(), model)
    off = {"enabled": False, "reason": "timing the step alone"}
    self_check(parse_config(run_config(tmp_path, train={"self_check": off})), ParallelState(), model)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("self-check: passed in ") and "generated vs upstream" in lines[0], lines
    assert (
        lines[1] == "self-check: OFF, this run's layout is unproven (train.self_check.reason: timing the step alone)"
    ), lines


def test_self_check_off_needs_a_reason(tmp_path: Path) -> None:
    """A bare ``false`` (or an empty reason) is refused, one line naming the key and the form to write."""
    from runtime.config.errors import ConfigError
    from runtime.train.config import parse_config

    for off in (False, {"enabled": False}, {"enabled": False, "reason": "  "}):
        with pytest.raises(ConfigError) as caught:
            parse_config(run_config(tmp_path, train={"self_check": off}))
        assert caught.value.messages == [
            'train.self_check: false needs a reason: write `self_check: {enabled: false, reason: "why this run may '
            'train with its layout unproven"}` (printed at start, recorded in checkpoints and exports)'
        ], off
    assert parse_config(run_config(tmp_path, train={"self_check": True})).train.self_check.enabled


def test_shrink_keeps_the_jobs_options_and_drops_its_sizes_and_token_ids() -> None:
    job = {
        **{k: v * 64 for k, v in QWEN3_TINY.items()},
        "vocab_size": 151936,
        "rope_theta": 1e6,
        "final_logit_softcapping": 30.0,
        "attention_bias": True,
        "hidden_act": "gelu",
        "attention_dropout": 0.1,
        "sliding_window": 4096,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "bos_token_id": 151643,
        "image_token_index": 151655,
        "moe_intermediate_size": 768,
        "architectures": ["Qwen3ForCausalLM"],
        "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "max_position_embeddings": 131072,
    }
    tiny = {**QWEN3_TINY, "vocab_size": 97, "sliding_window": 6, "max_position_embeddings": 128}
    out = shrink_values(job, tiny, ShrinkLayout(row_length=23))
    assert out["rope_theta"] == 1e6 and out["final_logit_softcapping"] == 30.0  # floats: the job's
    assert out["attention_bias"] is True and out["hidden_act"] == "gelu"  # booleans, strings: the job's
    assert out["rope_parameters"] == job["rope_parameters"]  # the scaling the job computes with
    assert out["vocab_size"] == 97 and out["hidden_size"] == 64  # sizes: the tiny config's
    assert out["sliding_window"] == 6  # capped below the proof's documents
    assert out["layer_types"] == ["sliding_attention", "full_attention"] and out["num_hidden_layers"] == 2
    assert out["attention_dropout"] == 0.0  # randomness is not what the proof compares
    assert out["max_position_embeddings"] == 131072  # the yarn scaling's ratio to its original length kept
    for dropped in ("bos_token_id", "image_token_index", "moe_intermediate_size", "architectures", "dtype"):
        assert dropped not in out, dropped  # big token ids and sizes the tiny config lacks: config defaults


def test_shrink_fits_the_layout() -> None:
    tiny = {"num_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1, "num_attention_heads": 4}
    job = {"num_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 2, "num_attention_heads": 32}
    out = shrink_values(job, tiny, ShrinkLayout(ep_size=4, head_split=8))
    assert out["num_experts"] == 4 and out["n_shared_experts"] == 1  # a multiple of ep >= top-k; shared: not sharded
    assert out["num_attention_heads"] == 8  # Ulysses 8 splits them
    assert shrink_values(job, tiny, ShrinkLayout(ep_size=3))["num_experts"] == 6  # 3 divides the tiny count
    assert shrink_values({"sliding_window": None}, {"sliding_window": 6}, ShrinkLayout())["sliding_window"] is None
    sub = shrink_values({"text_config": {"vocab_size": 9000}}, {"text_config": {"vocab_size": 97}}, ShrinkLayout())
    assert sub == {"text_config": {"vocab_size": 97}}


def test_shrunk_towers_keep_one_block_or_every_listed_one() -> None:
    """A tower's blocks all run the same SP sites: one is kept, or as many as an index list reaches (audio encoders
    count ``encoder_layers``); the language model keeps the tiny config's layers."""
    tower, text = ShrinkLayout(tower=True), ShrinkLayout()
    deepstack = {"depth": 3, "deepstack_visual_indexes": [0, 1]}
    assert shrink_values({"depth": 27}, deepstack, tower) == {"depth": 2, "deepstack_visual_indexes": [0, 1]}
    full_attention = {"depth": 3, "fullatt_block_indexes": [2], "window_size": 16}
    assert shrink_values({"depth": 32}, full_attention, tower)["depth"] == 3  # block 2 (full attention) stays
    assert shrink_values({"depth": 32}, {"depth": 3}, tower)["depth"] == 1
    assert shrink_values({"encoder_layers": 32}, {"encoder_layers": 2}, tower)["encoder_layers"] == 1
    assert shrink_values({"num_hidden_layers": 28}, {"num_hidden_layers": 3}, text)["num_hidden_layers"] == 3


@pytest.mark.parametrize(
    ("types", "layers", "expected"),
    [
        (["a", "a", "a", "b"], 2, ["a", "b"]),
        (["a", "b", "a", "b"], 2, ["a", "b"]),
        (["a", "b", "c"], 2, ["a", "b", "c"]),
        (["a", "a", "b", "a"], 3, ["a", "a", "b"]),
    ],
)
def test_layer_types_keep_every_type(types: list[str], layers: int, expected: list[str]) -> None:
    assert fit_layer_types(types, layers) == expected


def test_the_proof_leaves_the_jobs_random_stream_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with untouched_rng(torch.device("cpu")):
        torch.manual_seed(0)
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected)


def test_vision_language_proof_rows_hold_an_image_on_even_replicas() -> None:
    """Replica 0's row ends with an image sample (its image tokens, pixels and grid; M-RoPE ids from the model's
    get_rope_index), replica 1's has none (its rank runs the tower's dummy forward); the reference row holds both
    rows' tokens and replica 0's image; no label crosses a document."""
    from runtime.models.registry import lookup
    from runtime.train.self_check_text import proof_rows, shrunk_text_config
    from runtime.train.self_check_vision import GRID, concatenated

    shrunk = shrunk_text_config(job_config("qwen3_vl"), ParallelState())
    model = lookup("qwen3_vl").model_class()(shrunk)
    rows = proof_rows(2, shrunk, True, model)
    assert "pixel_values" in rows[0] and "pixel_values" not in rows[1]
    image_tokens = int((rows[0]["input_ids"] == shrunk.image_token_id).sum())
    assert image_tokens == GRID[0] * GRID[1] * GRID[2] // 4  # 2x2 merge
    assert rows[0]["position_ids"].shape == (4, 1, rows[0]["input_ids"].shape[1])
    assert not torch.equal(rows[0]["position_ids"][1], rows[0]["position_ids"][0])  # M-RoPE, not the text row
    row = concatenated(rows)
    assert row["input_ids"].shape[1] == sum(r["input_ids"].shape[1] for r in rows)
    assert torch.equal(row["pixel_values"], rows[0]["pixel_values"])
    starts = (row["position_ids"][0, 0] == 0).nonzero().flatten()
    assert (row["labels"][0, starts] == -100).all()


def test_a_run_without_its_proof_says_so_and_records_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Off with a reason: the start-up line says the layout is unproven and why; the checkpoint's identity and the
    export's marker record it (a run with the proof records nothing: ``test_export_generate``'s export)."""
    from runtime.checkpoint.dcp import COMPLETE_MARKER
    from runtime.checkpoint.export import EXPORT_MARKER

    raw = run_config(
        tmp_path,
        train={"steps": 1, "self_check": {"enabled": False, "reason": "bench"}},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 1},
        export={"dir": str(tmp_path / "hf")},
    )
    code, err = run_main(raw, tmp_path)
    assert code == 0, err
    record = "layout unproven (self_check off: bench)"
    assert "self-check: OFF, this run's layout is unproven (train.self_check.reason: bench)" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / EXPORT_MARKER).read_text())["layout"] == record
    (marker,) = (tmp_path / "ckpt").glob(f"*/{COMPLETE_MARKER}")
    assert json.loads(marker.read_text())["model"]["layout"] == record


@pytest.mark.dist
def test_replicas_rows_stay_apart_in_the_reference(tmp_path: Path) -> None:
    """A model whose layer carries state along the row (a running mean, as a recurrence over packed rows) at
    dp_shard 2: each replica runs its own row, and so must the one-process reference; it packed both replicas' rows
    into one, so replica 1's tokens saw replica 0's and a correct job was refused."""
    raw = run_config(tmp_path, parallel={"dp_shard": 2}, model={"config": TINY_MODEL})
    results = run_distributed(check_worker, 2, raw, RecurrentQwen3, {}, RecurrentUpstreamQwen3, timeout=300)
    out, error = results[0]
    assert error == "" and out.startswith("self-check: passed in "), results
