"""The start-up self-check proves its own power on the job in hand (``runtime/train/self_check_power.py``).

A proof that cannot fail has proven nothing: planted defects (one attention site local, positions restarting at the
shard boundary, a replica's share doubled, a handled option skipped) must each land outside the tolerance, or the
run is refused naming what the proof could not reach. The proof's inputs must reach the job's own regimes: a
position threshold the model's code reads from its config is brought inside the proof's rows, and a softcap is set
where it binds. Each side is shown here to matter: the regime that hides a defect without it, the refusal with it.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers

from patchgen.config import load_config
from patchgen.project import regen
from patchgen.spec_set import load_specs
from runtime.config.errors import ConfigError
from runtime.models.tiny_configs import random_packed_batch
from runtime.train.self_check import FP32_TOLERANCE, Comparison, Proof, compare, gradients, report
from runtime.train.self_check_power import binding_softcaps, handled_defects
from runtime.train.self_check_shrink import ShrinkLayout, config_reads, crossed_thresholds, shrink_values
from tests.dist_utils import run_distributed
from tests.engine.helpers import REPO
from tests.train.common import run_config

OUTPUT = "generated/position_scale/modeling_qwen3.py"
NEXT_OUTPUT = "generated/unsplit_mixer/modeling_qwen3_next.py"
# Queries scaled past a configured floor by a function of the position, the positions from torch.arange over the
# tokens the layer holds (a rank under SP holds its own slice: its positions restart at 0 there).
POSITION_SCALE = """{#
op = "insert"
doc = "test only: the queries scaled past a floor, positions counted over the tokens this layer holds"
#}
floor = getattr(self.config, "query_scale_floor", None)
if floor is not None:
    positions = torch.arange(query_states.shape[2], device=query_states.device)
    scale = 1.0 + torch.log1p(torch.floor(positions / floor))
    query_states = query_states * scale.to(query_states.dtype)[None, None, :, None]
"""
PATCH = """
[[patch]]
template = "test/position_scale"
scope = "Qwen3Attention.forward"
after = "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"
why = "a position-dependent query scale, past a floor the config sets"
"""


def _passed(power: float, tol: float = FP32_TOLERANCE) -> Comparison:
    return Comparison("planted", power, {"w": power}, tol)


def test_a_blind_planted_defect_refuses_the_run_naming_it() -> None:
    layout = Comparison("sp 2 vs one process", 1e-7, {"w": 2e-7}, FP32_TOLERANCE)
    blind = Comparison("positions restart at the shard boundary", 3e-7, {"w": 4e-7}, FP32_TOLERANCE)
    with pytest.raises(ConfigError) as caught:
        report(Proof("2 layers", [layout], [_passed(0.5), blind]), 0.1, "train.self_check")
    message = str(caught.value)
    assert "cannot fail on this job" in message, message
    assert "positions restart at the shard boundary (moved it by 4.0e-07)" in message, message
    assert "\n" not in message and "{enabled: false, reason: ...}" in message
    line = report(Proof("2 layers", [layout], [_passed(0.5), _passed(2e-2)]), 0.1, "train.self_check")
    assert line.endswith("tolerance 1e-04; power: 2 planted defects detected, smallest margin 200x)"), line
    advisory = {blind.what: "its regime is set by the weights"}  # said in the line, not a refusal
    line = report(Proof("2 layers", [layout], [_passed(0.5), blind], advisory), 0.1, "train.self_check")
    assert line.endswith(
        "power: 1 planted defect detected, smallest margin 5000x; not detectable on this job: positions restart at "
        "the shard boundary (0.00x the tolerance: its regime is set by the weights))"
    ), line
    line = report(Proof("2 layers", [layout], []), 0.1, "train.self_check")
    assert line.endswith("power: no layout defect to plant in one process)"), line


def test_a_threshold_the_model_reads_is_brought_inside_the_rows() -> None:
    source = (
        'floor = getattr(self.config, "query_scale_floor", None)\n'
        "n = config.n_group\nc = self.config.attention_chunk_size"
    )
    reads = config_reads(source)
    assert reads == {"query_scale_floor", "n_group", "attention_chunk_size"}
    job = {"query_scale_floor": 8192, "n_group": 8, "attention_chunk_size": 8192, "other_floor": 8192}
    layout = ShrinkLayout(row_length=23, reads=reads)
    shrunk = shrink_values(job, {}, layout)
    # read thresholds capped at a quarter of the row; a grouping count and a key the code never reads kept
    assert shrunk == {"query_scale_floor": 5, "n_group": 8, "attention_chunk_size": 5, "other_floor": 8192}
    crossed = ["attention_chunk_size 8192 -> 5", "query_scale_floor 8192 -> 5"]
    assert crossed_thresholds(job, shrunk, layout) == crossed


def test_a_softcap_that_never_binds_hides_a_skipped_cap_until_set_to_bind() -> None:
    """Gemma2 (upstream transformers) applies ``final_logit_softcapping`` after the LM head: at a real model's 30,
    random weights' logits are far below it and skipping the cap moves nothing past the tolerance; set to the
    largest logit, the skipped cap is detected."""
    config = transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        sliding_window=6, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    row = random_packed_batch((7, 11, 5), 90, seed=3)
    reads = config_reads(inspect.getsource(sys.modules[transformers.Gemma2ForCausalLM.__module__]))

    def moved_by_skipping(config: transformers.Gemma2Config) -> float:
        torch.manual_seed(0)
        model = transformers.Gemma2ForCausalLM(config)
        model(**row).loss.backward()
        loss, grads = model(**row).loss.detach(), gradients(model)
        [defect] = handled_defects(config, ["final_logit_softcapping"])
        model.zero_grad()
        with defect.plant(model):
            model(**row).loss.backward()
            planted = compare(defect.name, model(**row).loss.detach(), gradients(model), loss, grads, FP32_TOLERANCE)
        return max(planted.loss_error, planted.worst()[1])

    assert moved_by_skipping(config) < FP32_TOLERANCE  # the regime hides it: a proof here would have no power
    torch.manual_seed(0)
    changed = binding_softcaps(transformers.Gemma2ForCausalLM(config), config, row, reads)
    assert [c.split()[0] for c in changed] == ["attn_logit_softcapping", "final_logit_softcapping"], changed
    assert config.final_logit_softcapping < 1.0
    assert moved_by_skipping(config) > 10 * FP32_TOLERANCE


def _position_scale_project(root: Path) -> Path:
    root.mkdir()
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(REPO / "templates", root / "templates")
    (root / "templates" / "test").mkdir()
    (root / "templates" / "test" / "position_scale.py.j2").write_text(POSITION_SCALE)
    spec = re.sub(r'output = "[^"]*"', f'output = "{OUTPUT}"', (REPO / "specs" / "qwen3.toml").read_text(), count=1)
    (root / "specs").mkdir()
    (root / "specs" / "qwen3.toml").write_text(spec + PATCH)
    config = load_config(root)
    regen(config, load_specs(config, ["qwen3"]))
    return root / OUTPUT


def position_scale_worker(rank: int, world_size: int, raw: dict, path: str) -> tuple[str, str]:
    """The text self-check of ``raw`` on a job whose floor is a real model's (8192), with the generated class of the
    module at ``path`` on both sides (the feature is the model's own: only the layout is on trial)."""
    from tests.train.self_check_defects import check_worker

    spec = importlib.util.spec_from_file_location(f"position_scale_{rank}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cls = module.Qwen3ForCausalLM

    class AsUpstream(cls):  # built as the proof builds an Auto class
        @classmethod
        def from_config(klass, config, **kwargs):
            return klass._from_config(config, **kwargs)

    return check_worker(rank, world_size, raw, cls, {"query_scale_floor": 8192}, upstream_class=AsUpstream)


@pytest.mark.dist
def test_a_position_dependent_scale_past_a_real_floor_is_refused_under_sp(tmp_path: Path) -> None:
    """Rows of about 24 tokens never reach a floor of 8192: the proof brings it inside them (the line says so), so
    that sp = 2, whose ranks count positions from 0, is refused before step 1, while a data-parallel layout (whole
    rows per rank) passes."""
    path = str(_position_scale_project(tmp_path / "project"))
    raw = run_config(tmp_path, parallel={"dp_shard": 2})
    out, error = run_distributed(position_scale_worker, 2, raw, path, timeout=300)[0]
    assert error == "" and "thresholds inside its rows: query_scale_floor 8192 -> 5" in out, (out, error)
    raw = run_config(tmp_path, parallel={"sp": 2})
    results = run_distributed(position_scale_worker, 2, raw, path, timeout=300)
    error = results[0][1]
    assert all(e == error for _, e in results) and "\n" not in error, results
    assert error.startswith("train.self_check: the start-up self-check failed: ") and "sp 2" in error, error


def _unsplit_delta_net_project(root: Path) -> Path:
    """The shipped Qwen3-Next spec without its delta-net SP patches: the gated delta-net layers (a convolution and a
    recurrence, no class named *Attention, so the per-forward site check does not watch them) run on each rank's
    tokens only, while the full-attention layers keep Ulysses."""
    root.mkdir()
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(REPO / "templates", root / "templates")
    text = (REPO / "specs" / "qwen3_next.toml").read_text()
    head, *patches = re.sub(r'output = "[^"]*"', f'output = "{NEXT_OUTPUT}"', text, count=1).split("[[patch]]")
    kept = [p for p in patches if "sp/linear_attention" not in p]
    assert len(kept) == len(patches) - 2
    (root / "specs").mkdir()
    (root / "specs" / "qwen3_next.toml").write_text("[[patch]]".join([head, *kept]))
    config = load_config(root)
    regen(config, load_specs(config, ["qwen3_next"]))
    return root / NEXT_OUTPUT


def unsplit_mixer_worker(rank: int, world_size: int, raw: dict, path: str | None) -> tuple[str, str]:
    """The qwen3_next self-check with the generated class of the module at ``path`` (None: the shipped class)."""
    from tests.train.self_check_defects import check_worker

    if path is None:
        return check_worker(rank, world_size, raw, None, {})
    spec = importlib.util.spec_from_file_location(f"unsplit_mixer_{rank}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return check_worker(rank, world_size, raw, module.Qwen3NextForCausalLM, {})


@pytest.mark.dist
def test_a_sequence_mixer_that_is_not_attention_is_proven_under_sp(tmp_path: Path) -> None:
    """The shipped Qwen3-Next passes at sp = 2 with the planted defects detected; with its delta-net layers left
    unsplit it is refused before step 1, in one line, on every rank: by the per-forward site check, which watches the
    gated delta-net (no class name says attention) because the proof's census found it mixing the sequence."""
    raw = run_config(tmp_path, model={"type": "qwen3_next", "config": {}}, parallel={"sp": 2})
    out, error = run_distributed(unsplit_mixer_worker, 2, raw, None, timeout=300)[0]
    # a local attention site, RoPE restarting, a local convolution and a local recurrence: the decays set to remember
    # across the rows (at random init's a local recurrence moved ring 2 by a third of the tolerance only)
    assert error == "" and "power: 4 planted defects detected" in out, (out, error)
    assert "recurrences set to remember: A_log -> log 1e-2" in out, out
    ring = run_config(tmp_path, model={"type": "qwen3_next", "config": {}}, parallel={"sp": 2, "ring": 2})
    out, error = run_distributed(unsplit_mixer_worker, 2, ring, None, timeout=300)[0]
    assert error == "" and "power: 4 planted defects detected" in out and "not detectable" not in out, (out, error)
    path = str(_unsplit_delta_net_project(tmp_path / "project"))
    results = run_distributed(unsplit_mixer_worker, 2, raw, path, timeout=300)
    error = results[0][1]
    assert all(e == error for _, e in results) and "\n" not in error, results
    assert error.startswith(
        "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet) ran under parallel.sp = 2 without "
        "passing through a patched attention site"
    ), error


def test_proof_tokens_avoid_special_ids_without_collapsing_to_one() -> None:
    """The proof's text tokens: not the special ids at the bottom of a vocabulary (Mistral's bos 1 and eos 2, which
    once left the single id 1 to draw from: every position equal, no planted defect could move anything), and
    nothing from the lowest special id at its top (a vision-language model's image token)."""
    import transformers

    from runtime.train.self_check_text import text_tokens

    mistral = text_tokens(transformers.MistralConfig(vocab_size=64))
    assert mistral.tolist() == list(range(3, 64))
    vlm = transformers.Qwen2Config(vocab_size=512, bos_token_id=1, eos_token_id=[2, 7], image_token_id=300)
    assert text_tokens(vlm).tolist() == [t for t in range(3, 300) if t != 7]
