import json

import pytest
import torch
from peft import LoraConfig
from torch import nn

from runtime.rl.adapters.nondiffusers import NonDiffusersModelBase


class ToyBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x, scale):
        return x + self.ff(torch.nn.functional.gelu(self.to_q(self.norm(x)))) * scale


class ToyDenoiser(NonDiffusersModelBase):
    _no_split_modules = ["ToyBlock"]

    def __init__(self, config):
        super().__init__(config)
        dim = config["dim"]
        self.proj_in = nn.Linear(config["in_channels"], dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(config["num_layers"]))
        self.proj_out = nn.Linear(dim, config["in_channels"])

    def forward(self, x):
        h = self.proj_in(x)
        for block in self.blocks:
            h = self.maybe_checkpoint(block, h, 0.5)
        return self.proj_out(h)


CONFIG = {"dim": 16, "in_channels": 8, "num_layers": 3}
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "ff"], init_lora_weights=False)


def _model(seed=0):
    torch.manual_seed(seed)
    return ToyDenoiser(CONFIG)


def _x():
    return torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))


def test_lora_disabled_equals_base_bitwise():
    base = _model()
    x = _x()
    ref = base(x)
    lora = _model()
    lora.add_adapter(LORA)
    assert lora.adapter_names == ["default"]
    with_lora = lora(x)
    assert not torch.allclose(with_lora, ref)  # random B: the adapter really changes the output
    lora.disable_adapters()
    assert torch.equal(lora(x), ref)
    lora.enable_adapters()
    assert torch.equal(lora(x), with_lora)
    trainable = {n for n, p in lora.named_parameters() if "lora_" in n}
    assert trainable and all(".to_q." in n or ".ff." in n for n in trainable)


def test_adapter_without_adapters_raises():
    with pytest.raises(ValueError, match="no adapters"):
        _model().disable_adapters()


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_lora", [False, True])
def test_checkpointed_gradients_equal_plain(with_lora):
    model = _model()
    if with_lora:
        model.add_adapter(LORA)
    x = _x()
    plain = _grads(model, x)
    model.gradient_checkpointing_enable()
    ckpt = _grads(model, x)
    assert plain.keys() == ckpt.keys() and plain
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name


def test_checkpointing_inactive_without_grad(monkeypatch):
    import runtime.rl.adapters.nondiffusers as nd

    calls = []
    real = nd.checkpoint
    monkeypatch.setattr(nd, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model()
    model.gradient_checkpointing_enable()
    with torch.no_grad():
        model(_x())
    assert calls == []
    model(_x())
    assert len(calls) == CONFIG["num_layers"]


def test_save_load_round_trip(tmp_path):
    model = _model()
    x = _x()
    model.save_pretrained(tmp_path / "base")
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    assert cfg["_class_name"] == "ToyDenoiser" and cfg["dim"] == 16
    loaded = ToyDenoiser.from_pretrained(tmp_path / "base")
    assert torch.equal(loaded(x), model(x))

    # with LoRA: base weights under the original names, the adapter in peft's format
    model.add_adapter(LORA)
    model.save_pretrained(tmp_path / "lora_base")
    model.save_adapter(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    again = ToyDenoiser.from_pretrained(tmp_path / "lora_base")
    assert torch.equal(again(x), loaded(x))
    again.load_adapter(tmp_path / "adapter")
    assert torch.equal(again(x), model(x))

    # merged export equals the adapted model (up to float rounding of the merge)
    model.save_pretrained(tmp_path / "merged", merge_adapters=True)
    merged = ToyDenoiser.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(x), model(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(model.base_state_dict()["blocks.0.to_q.weight"], loaded.blocks[0].to_q.weight)


def test_from_pretrained_wrong_class(tmp_path):
    class Other(ToyDenoiser):
        pass

    _model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a Other"):
        Other.from_pretrained(tmp_path)
