"""`patchgen draft` on decoder LMs with structures beyond the dense and MoE kinds: Llama 4's position-dependent
attention (one complex RoPE tensor, positions counted from the layer's own length, a layer that does not pass the
position ids on, a vision tower in the same module, experts without transformers' experts interface) and
Qwen3-Next's gated delta-net layers; the recognisers state what they do not serve, never guess. Renders and
generates without torch (a few seconds)."""

from __future__ import annotations

import tomllib

import pytest

from patchgen.config import load_config
from patchgen.draft.pipeline import draft_spec
from patchgen.draft.reproduce import NOT_REPRODUCED, reproduce
from patchgen.upstream import PinnedSource
from tests.engine.helpers import REPO


def _draft(model_type: str) -> dict:
    config = load_config(REPO)
    return tomllib.loads(draft_spec(model_type, PinnedSource(config.pins), config.pins).text)


def test_llama4_text_code_is_reproduced_and_its_record_differs_by_hand_choices() -> None:
    """Every generated line equal to the shipped spec's; the record differs in the tiny config (set by hand past
    the thresholds of the position-dependent attention) and the wording of the ep reason alone."""
    config = load_config(REPO)
    outcome = reproduce(config, "llama4_text", PinnedSource(config.pins))
    assert outcome.code_equal and not outcome.record_equal, outcome.why
    keys = [r.split(":")[0] for r in outcome.why.split("; ") if r.startswith("record ")]
    assert keys == ["record supports", "record tiny"], outcome.why
    assert "unsupported" in outcome.why.split("; ")[0] and "hand choice" in NOT_REPRODUCED["llama4_text"]


def test_llama4_text_is_named_by_its_model_type_and_its_structures_found() -> None:
    """llama4_text is one model of the llama4 folder (whose `llama4` is the VLM): the spec and output are named by
    the model type. The vision attention (reachable only through `_init_weights`) gets no patch; the experts run
    without the experts interface, so EP is stated, not planned."""
    spec = _draft("llama4_text")
    assert spec["output"] == "generated/llama4_text/modeling_llama4.py"
    by_template = {p["template"]: p for p in spec["patch"]}
    assert by_template["sp/rope_slice"]["vars"] == {"form": "tensor"}
    assert by_template["sp/global_token_positions"]["scope"] == "Llama4TextAttention.forward"
    assert by_template["sp/attention_position_ids"]["anchor"] == "self.self_attn"
    assert [p["scope"] for p in spec["patch"] if p["template"] == "sp/ulysses_attention"] == [
        "Llama4TextAttention.forward"
    ]
    assert "moe/ep_plan" not in by_template
    assert "Llama4TextExperts (transformers/models/llama4/modeling_llama4.py:" in spec["model"]["unsupported"]["ep"]


def test_dense_models_gain_no_position_patch() -> None:
    """llama passes the position ids to its attention and counts no positions itself: none of the new kinds."""
    templates = {p["template"] for p in _draft("llama")["patch"]}
    assert not templates & {"sp/global_token_positions", "sp/attention_position_ids", "core/native_weight_init"}


def test_qwen3_next_code_is_reproduced_and_its_tiny_config_is_the_only_difference() -> None:
    """Its gated delta-net layers drafted as the shipped spec splits them; the record differs in one hand-chosen
    tiny value (NOT_REPRODUCED)."""
    config = load_config(REPO)
    outcome = reproduce(config, "qwen3_next", PinnedSource(config.pins))
    assert outcome.code_equal, outcome.why
    reasons = outcome.why.split("; ")
    assert reasons[0] == "record tiny: shared_expert_intermediate_size 32 -> 48", outcome.why
    assert all(r == "only the patches' why in the markers differs" for r in reasons[1:]), outcome.why
    assert "hand choice" in NOT_REPRODUCED["qwen3_next"]


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_a_gated_delta_net_is_split_by_the_linear_attention_kinds(model_type: str) -> None:
    """The convolution and the recurrence of each gated delta-net are the two linear-attention kinds, the record
    states that the trainer hands the mixer the packed boundaries, and the tiny config runs both layer kinds with q
    and k repeated (a variant without). qwen3_5_moe_text is no shipped spec: the same layers in another model."""
    spec = _draft(model_type)
    assert "unsupported" not in spec["model"]
    patches = {p["template"]: p for p in spec["patch"]}
    assert patches["sp/linear_attention_conv"]["vars"] == {"conv": "self.conv1d"}
    assert patches["sp/linear_attention_heads"]["anchor"] == "self.chunk_gated_delta_rule"
    assert "core/native_weight_init" in patches
    assert spec["model"]["data"]["packed_documents"] == "cu_seq_lens"
    assert spec["model"]["tiny"]["layer_types"] == ["linear_attention", "full_attention"]
    assert spec["model"]["data"]["tiny_variants"]["no_repeat"] == {
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
    }


def test_a_delta_net_of_another_shape_is_stated() -> None:
    """olmo_hybrid's gated delta-net convolves otherwise (no depthwise nn.Conv1d with kernel - 1 padding): no SP
    patch at all, and the reason names the class with its file:line."""
    spec = _draft("olmo_hybrid")
    assert not any(p["template"].startswith(("sp/", "loss/")) for p in spec.get("patch", []))
    assert (
        "OlmoHybridGatedDeltaNet (transformers/models/olmo_hybrid/modeling_olmo_hybrid.py:"
        in (spec["model"]["unsupported"]["sp"])
    )
