"""Tiny DiT cases shared by the parity, SP and checkpoint tests: configs, random inputs and paired models.

Token counts are chosen not divisible by 2 or 4, so every SP run exercises the padding path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.diffusion.registry import lookup_dit, tiny_config, training_class
from runtime.diffusion.tiny import WAN_I2V_TEXT_LEN


@dataclass(frozen=True)
class Case:
    """One model configuration and input shape."""

    name: str
    model_type: str
    config: dict[str, Any]
    shape: dict[str, int] = field(default_factory=dict)

    @property
    def upstream_class(self) -> type:
        return lookup_dit(self.model_type).upstream_class()

    @property
    def shell_class(self) -> type:
        return training_class(self.model_type)


# frames 3, 6x10 latents -> 3 * 3 * 5 = 45 tokens (odd: padded for sp=2 and sp=4)
CASES = {
    "wan_t2v": Case(
        "wan_t2v", "wan", tiny_config("wan"), {"batch": 2, "frames": 3, "height": 6, "width": 10, "text": 7}
    ),
    "wan_i2v": Case(
        "wan_i2v",
        "wan",
        tiny_config("wan", "i2v"),
        {"batch": 1, "frames": 3, "height": 6, "width": 10, "text": WAN_I2V_TEXT_LEN},
    ),
}


def inputs(case: Case, seed: int = 1) -> dict[str, Any]:
    """Random forward kwargs for ``case`` (never zeros), identical for a given seed."""
    g = torch.Generator().manual_seed(seed)
    s = case.shape

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    if case.model_type == "wan":
        cfg = case.config
        out = {
            "hidden_states": randn(s["batch"], cfg["in_channels"], s["frames"], s["height"], s["width"]),
            "timestep": torch.rand(s["batch"], generator=g) * 1000,
            "encoder_hidden_states": randn(s["batch"], s["text"], cfg["text_dim"]),
            "return_dict": False,
        }
        if cfg.get("image_dim"):
            out["encoder_hidden_states_image"] = randn(s["batch"], 5, cfg["image_dim"])
        return out
    raise KeyError(case.model_type)


def target_like(output: torch.Tensor, seed: int = 2) -> torch.Tensor:
    return torch.randn(output.shape, generator=torch.Generator().manual_seed(seed))


def shell(case: Case, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """The generated trainable class, random weights from ``seed``."""
    torch.manual_seed(seed)
    cls = case.shell_class
    return cls(cls.config_class(**case.config, **config_overrides))


def upstream_like(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    """diffusers' own class with ``model``'s weights."""
    ref = case.upstream_class(**case.config)
    ref.load_state_dict(model.state_dict())
    return ref


def loss_and_grads(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Forward, MSE against a fixed random target, backward: (output, loss, every parameter's gradient)."""
    out = model(**kwargs)[0]
    loss = torch.nn.functional.mse_loss(out, target_like(out))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.detach(), loss.detach(), grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
