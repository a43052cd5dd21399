"""A full Qwen3-Omni checkpoint (thinker + talker + code2wav) loads into the generated thinker exactly as into
upstream's (the same weights, the same ``loading_info``: a generated class accepts what upstream accepts), and our
trainer's loader is where strictness lives: the talker's and code2wav's weights are dropped with one log line that
counts them, any other unexpected weight is an error naming it."""

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


def _with_extra_weight(path, tmp_path):
    weights = load_file(str(path / "model.safetensors"))
    weights["thinker.model.extra_head.weight"] = torch.randn(2, 2)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_bytes((path / name).read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path


def _load_both(path) -> tuple:
    """(generated model, its loading info, upstream model, its loading info), both from ``path``."""
    transformers.logging.set_verbosity_error()
    try:
        ours, ours_info = generated_class().from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        theirs, theirs_info = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
    finally:
        transformers.logging.set_verbosity_warning()
    return ours, ours_info, theirs, theirs_info


@pytest.mark.parametrize("extra", [False, True], ids=["full", "full+unknown"])
def test_the_generated_thinker_loads_what_upstream_loads(full_checkpoint, tmp_path, extra) -> None:
    path, full = full_checkpoint
    path = _with_extra_weight(path, tmp_path) if extra else path
    ours, ours_info, theirs, theirs_info = _load_both(path)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert sorted(map(str, ours_info[key])) == sorted(map(str, theirs_info[key])), key
    assert ("thinker.model.extra_head.weight" in ours_info["unexpected_keys"]) == extra
    ref = full.thinker.state_dict()
    got = ours.state_dict()
    assert got.keys() == ref.keys() == theirs.state_dict().keys()
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


def test_the_trainer_drops_the_left_out_parts_counted(full_checkpoint, caplog) -> None:
    from runtime.train.model import load_pretrained

    path, full = full_checkpoint
    # counted as the full model names them (the talker's per-expert checkpoint weights load stacked)
    others = [k for k in full.state_dict() if k.startswith(("talker.", "code2wav."))]
    with caplog.at_level(logging.WARNING, logger="runtime.models.submodel_checkpoint"):
        thinker = load_pretrained(generated_class(), str(path))
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        f"Qwen3OmniMoeThinkerForConditionalGeneration: dropped {len(others)} weights of talker.*, "
        "code2wav.* (parts of the full model this class leaves out)"
    ]
    ref = full.thinker.state_dict()
    for name, value in thinker.state_dict().items():
        assert torch.equal(value, ref[name]), name


def test_the_trainer_refuses_an_unknown_weight(full_checkpoint, tmp_path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.train.model import load_pretrained

    path = _with_extra_weight(full_checkpoint[0], tmp_path)
    with pytest.raises(ConfigError, match=r"unexpected keys thinker\.model\.extra_head\.weight;") as info:
        load_pretrained(generated_class(), str(path))
    assert "\n" not in str(info.value) and "talker" not in str(info.value)
