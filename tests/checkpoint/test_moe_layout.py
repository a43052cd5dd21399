"""MoE checkpoints: plain transformers' per-expert files load into the stacked layout and export back."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
import transformers

from runtime.checkpoint.export import export_hf
from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import tiny_config


def test_hf_moe_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    plain.save_pretrained(tmp_path / "hf")
    saved = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved  # the on-disk layout is per expert

    ours = causal_lm_class("qwen3_moe").from_pretrained(
        tmp_path / "hf", attn_implementation="sdpa", experts_implementation="eager"
    )
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # stacked in memory
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(1))
    plain.eval(), ours.eval()
    assert torch.equal(plain(ids).logits, ours(ids).logits)

    export_hf(ours, ours.config, tmp_path / "export")
    exported = safetensors.torch.load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == saved.keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="sdpa", experts_implementation="eager"
    )
    reloaded.eval()
    assert torch.equal(reloaded(ids).logits, plain(ids).logits)


def test_hf_vl_moe_transposed_checkpoint(tmp_path: Path) -> None:
    """qwen3_vl_moe releases store the stacked experts transposed, (experts, hidden, 2 * intermediate); transformers
    transposes them on load (only when the shape says so). The generated class opts in to that conversion."""
    from tests.parity.vlm import vlm_batch

    # 2 * moe_intermediate != hidden, so the transpose is decided by the shape, as for the real checkpoints
    config = tiny_config("qwen3_vl_moe", text_config={"moe_intermediate_size": 24})
    torch.manual_seed(0)
    plain = transformers.AutoModelForImageTextToText.from_config(config)
    plain.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    saved = safetensors.torch.load_file(path)
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert saved[key].shape == (8, 48, 64)  # save_pretrained writes the in-memory layout
    released = {
        k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
        for k, v in saved.items()
    }
    safetensors.torch.save_file(released, path, metadata={"format": "pt"})

    ours = causal_lm_class("qwen3_vl_moe").from_pretrained(
        tmp_path / "hf", attn_implementation="sdpa", experts_implementation="eager"
    )
    assert type(ours).__module__ == "generated.qwen3_vl_moe.modeling_qwen3_vl_moe"
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    batch = vlm_batch("qwen3_vl_moe")
    plain.eval(), ours.eval()
    assert torch.equal(plain(**batch).logits, ours(**batch).logits)

    export_hf(ours, ours.config, tmp_path / "export")
    exported = safetensors.torch.load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == saved.keys()
