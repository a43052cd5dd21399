"""MoE checkpoints: plain transformers' per-expert files load into the stacked layout and export back."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
import transformers

from runtime.checkpoint.export import export_hf
from runtime.models.registry import causal_lm_class
from runtime.models.tiny import tiny_config


def test_hf_moe_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    plain.save_pretrained(tmp_path / "hf")
    saved = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved  # the on-disk layout is per expert

    ours = causal_lm_class("qwen3_moe").from_pretrained(tmp_path / "hf", attn_implementation="sdpa",
                                                         experts_implementation="eager")
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # stacked in memory
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(1))
    plain.eval(), ours.eval()
    assert torch.equal(plain(ids).logits, ours(ids).logits)

    export_hf(ours, ours.config, tmp_path / "export")
    exported = safetensors.torch.load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == saved.keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="sdpa",
                                                                 experts_implementation="eager")
    reloaded.eval()
    assert torch.equal(reloaded(ids).logits, plain(ids).logits)
