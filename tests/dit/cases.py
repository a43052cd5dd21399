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


# Wan: 3 frames of 6x10 latents -> 3 * 3 * 5 = 45 tokens (odd: padded for sp=2 and sp=4). Flux / Qwen-Image: 6x10
# latents packed 2x2 -> 3 x 5 = 15 image tokens; Qwen zero_cond_t adds a 2x3 condition image (21 tokens).
VIDEO = {"frames": 3, "height": 6, "width": 10}
IMAGE = {"height": 3, "width": 5, "text": 7}
CASES = {
    "wan_t2v": Case("wan_t2v", "wan", tiny_config("wan"), {**VIDEO, "batch": 2, "text": 7}),
    "wan_i2v": Case("wan_i2v", "wan", tiny_config("wan", "i2v"), {**VIDEO, "batch": 1, "text": WAN_I2V_TEXT_LEN}),
    "flux": Case("flux", "flux", tiny_config("flux"), {**IMAGE, "batch": 2}),
    "qwenimage": Case("qwenimage", "qwenimage", tiny_config("qwenimage"), {**IMAGE, "batch": 2}),
    "hunyuanvideo": Case(
        "hunyuanvideo", "hunyuanvideo", tiny_config("hunyuanvideo"), {**VIDEO, "batch": 2, "text": 7}
    ),
    "qwenimage_zero_cond_t": Case(
        "qwenimage_zero_cond_t", "qwenimage", tiny_config("qwenimage", "zero_cond_t"), {**IMAGE, "batch": 1}
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
    if case.model_type == "hunyuanvideo":
        cfg = case.config
        mask = torch.ones(s["batch"], s["text"], dtype=torch.long)
        mask[-1, s["text"] - 3 :] = 0  # the last sample's prompt is 3 tokens shorter (padding)
        return {
            "hidden_states": randn(s["batch"], cfg["in_channels"], s["frames"], s["height"], s["width"]),
            "timestep": torch.rand(s["batch"], generator=g) * 1000,
            "encoder_hidden_states": randn(s["batch"], s["text"], cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
            "pooled_projections": randn(s["batch"], cfg["pooled_projection_dim"]),
            "guidance": torch.full((s["batch"],), 6000.0),
            "return_dict": False,
        }
    b, h, w, text = s["batch"], s["height"], s["width"], s["text"]
    cfg = case.config
    if case.model_type == "flux":
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3).float()
        return {
            "hidden_states": randn(b, h * w, cfg["in_channels"]),
            "encoder_hidden_states": randn(b, text, cfg["joint_attention_dim"]),
            "pooled_projections": randn(b, cfg["pooled_projection_dim"]),
            "timestep": torch.rand(b, generator=g),
            "img_ids": img_ids,  # (0, row, col) per packed token, as FluxPipeline lays them out
            "txt_ids": torch.zeros(text, 3),
            "guidance": torch.full((b,), 3.5),
            "return_dict": False,
        }
    if case.model_type == "qwenimage":
        shapes = [(1, h, w), (1, 2, 3)] if cfg.get("zero_cond_t") else [(1, h, w)]
        mask = torch.ones(b, text, dtype=torch.long)
        mask[-1, text - 2 :] = 0  # the last sample's prompt is 2 tokens shorter (padding)
        return {
            "hidden_states": randn(b, sum(f * y * x for f, y, x in shapes), cfg["in_channels"]),
            "encoder_hidden_states": randn(b, text, cfg["joint_attention_dim"]),
            "encoder_hidden_states_mask": mask,
            "timestep": torch.rand(b, generator=g),
            "img_shapes": [shapes] * b,
            "return_dict": False,
        }
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
    # None: a parameter upstream leaves out of the loss (e.g. Qwen-Image's last text MLP); compared as None
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.detach(), loss.detach(), grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
