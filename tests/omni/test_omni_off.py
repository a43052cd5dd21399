"""The generated qwen3_omni_moe thinker with parallelism off is bitwise equal to upstream's: logits, loss, the
load-balancing loss and every gradient, the audio encoder's included (front-end convolutions, attention layers,
projections), the ViT with its deepstack mergers, the router and the experts.

Rows: two images, an audio of 250 mel frames (three front-end windows, the last one partial; two attention windows)
and a video with its audio track (video and audio tokens interleaved by time); then audios alone (one shorter than a
window) with a video without audio track.
"""

from __future__ import annotations

import pytest
import torch

from tests.omni.omni import generated_class, omni_batch, omni_models, tiny_omni_config
from tests.parity.dense import grads

ROWS = {
    "image+audio+video_with_audio": (
        [("image", (1, 4, 6)), ("audio", 250), ("image", (1, 2, 4)), ("video+audio", (2, 2, 4), 1.0, 130)],
        (5, 3, 4, 2, 6),
    ),
    "audios+video": ([("audio", 37), ("video", (2, 2, 2), 0.5), ("audio", 210)], (4, 2, 3, 5)),
}
# parameter-name prefixes that must carry a gradient: every tower and the MoE parts of the LM
PARTS = (
    "audio_tower.conv2d1.",
    "audio_tower.conv2d3.",
    "audio_tower.conv_out.",
    "audio_tower.layers.1.self_attn.",
    "audio_tower.proj2.",
    "visual.blocks.0.",
    "visual.merger.",
    "visual.merger_list.1.",
    "model.layers.1.mlp.gate.",
    "model.layers.1.mlp.experts.",
)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_omni_bitwise_equal_to_upstream(row: str) -> None:
    upstream, generated = omni_models()
    assert type(generated).__module__ == "generated.qwen3_omni_moe.modeling_qwen3_omni_moe"
    for tower in (generated.audio_tower, generated.visual, generated.model):
        assert type(tower).__module__ == type(generated).__module__
    batch = omni_batch(*ROWS[row])
    outputs = [m(**batch, output_router_logits=True) for m in (upstream, generated)]
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    assert outputs[0].aux_loss > 0 and torch.equal(outputs[0].aux_loss, outputs[1].aux_loss)
    for out in outputs:
        out.loss.backward()
    ref, got = grads(upstream), grads(generated)
    assert ref.keys() == got.keys()
    for part in PARTS if row.startswith("image") else PARTS[:5]:
        assert any(n.startswith(part) for n in ref), part
    for name in ref:
        if row.startswith("image") or not name.startswith("visual.merger_list"):
            assert ref[name].abs().sum() > 0, name
        assert torch.equal(ref[name], got[name]), name


def test_position_id_func_gives_upstream_ids() -> None:
    """The data pipeline's per-sample M-RoPE ids (audio lengths, audio-in-video) are upstream's, and the generated
    model fed them as (4, 1, L) (text row first) computes exactly what upstream computes from the attention mask."""
    upstream, generated = omni_models()
    batch = omni_batch(*ROWS["image+audio+video_with_audio"])
    ref_ids, _ = upstream.get_rope_index(
        batch["input_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        batch["attention_mask"],
        True,
        batch["feature_attention_mask"].sum(-1),
        batch["video_second_per_grid"],
    )
    fn = generated_class().get_position_id_func(tiny_omni_config())
    ids = fn(
        batch["input_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        batch["feature_attention_mask"].sum(-1),
        True,
        batch["video_second_per_grid"],
    )
    assert torch.equal(ids, ref_ids)
    assert not torch.equal(ids[0], ids[1])  # really multimodal: T and H differ somewhere
    length = batch["input_ids"].shape[1]
    position_ids = torch.cat([torch.arange(length)[None, None].float(), ids], 0)  # (4, 1, L)
    explicit = {k: v for k, v in batch.items() if k != "attention_mask"}
    ref = upstream(**batch)
    got = generated(**explicit, position_ids=position_ids)
    assert torch.equal(ref.logits, got.logits)
    assert torch.equal(ref.loss, got.loss)


def test_talker_and_code2wav_are_pruned() -> None:
    import generated.qwen3_omni_moe.modeling_qwen3_omni_moe as module

    # (the config classes stay imported: imports are never pruned)
    names = [n for n in vars(module) if n.startswith("Qwen3OmniMoe") and not n.endswith("Config")]
    assert "Qwen3OmniMoeThinkerForConditionalGeneration" in names
    assert not [n for n in names if "Talker" in n or "Code2Wav" in n]


def test_random_init_equals_upstream() -> None:
    """Built directly from a config (the trainer's random init), the generated thinker has upstream's weights for
    the same seed: experts and router included, which upstream's _init_weights sets through the MoE block (a module
    without direct parameters, which transformers skips for classes it takes for custom code)."""
    import transformers

    config = tiny_omni_config()
    states = []
    for cls in (transformers.Qwen3OmniMoeThinkerForConditionalGeneration, generated_class()):
        torch.manual_seed(0)
        states.append(cls(config).state_dict())
    assert states[0].keys() == states[1].keys()
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name
    assert states[1]["model.layers.0.mlp.gate.weight"].std() > 0.01
