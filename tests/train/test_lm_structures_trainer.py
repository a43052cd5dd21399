"""The trainer on each language model of a structure first shipped with it at sp=2 (Ulysses) and ring=2 against
one process, every step: the
structures the project did not ship before (gpt_oss: attention sinks, eager attention because transformers refuses
sdpa for it, mask builders called without position ids, biased/interleaved/clamped experts on the layout kernel;
glm4_moe: an aux-loss-free sigmoid router with a bias-corrected choice, shared experts, a leading dense layer;
mimo_v2_flash: sinks on sliding layers only, value heads of another size, per-layer-type RoPE, eager attention)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.models.registry import lookup
from runtime.models.tiny_configs import tiny_config_dict
from tests.dist_utils import run_distributed
from tests.supports import require
from tests.train.common import assert_steps_match, one_process_steps, run_config, train_worker

# model type -> the run's model section beyond its tiny config (what its spec says it trains with)
MODELS = {
    "gpt_oss": {"attn_implementation": "eager", "experts_implementation": "patchgen_eager"},
    "glm4_moe": {"attn_implementation": "sdpa", "experts_implementation": "patchgen_grouped"},
    "mimo_v2_flash": {"attn_implementation": "eager", "experts_implementation": "patchgen_grouped"},
    "qwen3_next": {"attn_implementation": "sdpa", "experts_implementation": "patchgen_grouped"},
}


def _model(model_type: str) -> dict:
    config = {**tiny_config_dict(model_type), "vocab_size": 512, "max_position_embeddings": 512}
    assert lookup(model_type).data.get("attn_implementation", "sdpa") == MODELS[model_type]["attn_implementation"]
    return {"type": model_type, "config": config, **MODELS[model_type]}


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [{"sp": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_sp2_matches_sp1_every_step(tmp_path: Path, model_type: str, parallel: dict) -> None:
    """3 steps; loss and gradient norm within the rounding model (``tests.tolerance``: fp32 sums in another order
    across ranks; the one-process run on other kernels the witness, run alongside the reference)."""
    require(model_type, "ring" if "ring" in parallel else "sp")
    sections = {"model": _model(model_type), "train": {"steps": 3}}
    reference, witness = one_process_steps(run_config(tmp_path, **sections))
    per_rank = run_distributed(train_worker, 2, run_config(tmp_path, parallel=parallel, **sections), timeout=300)
    for rank_metrics in per_rank:
        assert [m["step"] for m in rank_metrics[:-1]] == [1, 2, 3]
        assert_steps_match(rank_metrics[:-1], reference, witness, f"{model_type} {parallel}")
