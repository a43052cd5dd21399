"""A full Qwen3-Omni checkpoint (thinker + talker + code2wav) loads into the generated thinker: the thinker's weights
arrive (``thinker.`` prefix stripped by transformers), the talker's and code2wav's are dropped with one log line that
counts them, and any other unexpected weight is an error."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.omni.omni import generated_class, tiny_omni_config

_TALKER_TEXT = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    vocab_size=64,
)
_PREDICTOR = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=64,
    num_code_groups=2,
)
_CODE2WAV = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=32,
    codebook_size=16,
    num_quantizers=2,
    decoder_dim=16,
    upsample_rates=[2],
    upsampling_ratios=[2],
)


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory) -> tuple:
    config = transformers.Qwen3OmniMoeConfig(
        thinker_config=tiny_omni_config().to_dict(),
        talker_config=dict(
            text_config=_TALKER_TEXT,
            code_predictor_config=_PREDICTOR,
            num_code_groups=2,
            thinker_hidden_size=64,
            spatial_merge_size=2,
        ),
        code2wav_config=_CODE2WAV,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3OmniMoeForConditionalGeneration(config)
    path = tmp_path_factory.mktemp("omni_full")
    model.save_pretrained(path)
    return path, model


def test_full_checkpoint_loads_into_the_thinker(full_checkpoint, caplog) -> None:
    path, full = full_checkpoint
    keys = load_file(str(path / "model.safetensors")).keys()
    assert any(k.startswith("talker.") for k in keys) and any(k.startswith("code2wav.") for k in keys)
    # counted as the full model names them (the talker's per-expert checkpoint weights load stacked)
    others = [k for k in full.state_dict() if k.startswith(("talker.", "code2wav."))]
    with caplog.at_level(logging.WARNING, logger="runtime.models.submodel_checkpoint"):
        thinker = generated_class().from_pretrained(path, dtype=torch.float32)
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        f"Qwen3OmniMoeThinkerForConditionalGeneration: dropped {len(others)} weights of talker.*, "
        "code2wav.* (parts of the full model this class leaves out)"
    ]
    ref = full.thinker.state_dict()
    got = thinker.state_dict()
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


def test_an_unknown_weight_is_an_error(full_checkpoint, tmp_path) -> None:
    path, _ = full_checkpoint
    weights = load_file(str(path / "model.safetensors"))
    weights["thinker.model.extra_head.weight"] = torch.zeros(2, 2)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_bytes((path / name).read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"1 weight\(s\) this model does not have: thinker\.model\.extra_head\.weight"
    ):
        generated_class().from_pretrained(tmp_path, dtype=torch.float32)
