"""Generated classes load every checkpoint layout their upstream classes load (issue 12 item 2): the [model] table
implies upstream's conversions for the model_type and for every class upstream keys a mapping by name."""

from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS, get_checkpoint_conversion_mapping

from runtime.models.registry import REGISTRY, lookup
from runtime.models.tiny_configs import tiny_config

TRANSFORMERS_MODELS = sorted(m.model_type for m in REGISTRY.values() if m.upstream.startswith("transformers."))


@pytest.mark.parametrize("model_type", TRANSFORMERS_MODELS)
def test_every_upstream_conversion_of_the_module_is_shared(model_type: str) -> None:
    entry = lookup(model_type)
    module = importlib.import_module(entry.module)
    classes = [
        name for name, value in vars(module).items() if isinstance(value, type) and value.__module__ == module.__name__
    ]
    expected = {name for name in [model_type, *classes] if get_checkpoint_conversion_mapping(name) is not None}
    assert expected <= USER_REGISTERED_MAPPINGS


def test_a_legacy_qwen2_5_vl_checkpoint_loads_every_weight(tmp_path) -> None:
    """Old Qwen2.5-VL checkpoints keep the LM at `model.*` and the ViT at `visual.*`."""
    entry = lookup("qwen2_5_vl")
    torch.manual_seed(0)
    upstream = entry.upstream_class().from_config(tiny_config("qwen2_5_vl"))
    upstream.save_pretrained(tmp_path)
    legacy = {}
    for key, value in load_file(tmp_path / "model.safetensors").items():
        for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if key.startswith(new):
                key = old + key[len(new) :]
        legacy[key] = value
    assert any(k.startswith("visual.") for k in legacy) and any(k.startswith("model.layers.") for k in legacy)
    save_file(legacy, tmp_path / "model.safetensors", metadata={"format": "pt"})
    generated, info = entry.model_class().from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    reference = upstream.state_dict()
    for name, value in generated.state_dict().items():
        assert torch.equal(value, reference[name]), name
