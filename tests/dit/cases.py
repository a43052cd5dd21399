"""Tiny DiT cases shared by the parity, SP, checkpoint and pipeline tests, read from the specs: every DiT spec's
tiny config and each of its ``tiny_variants`` is a case (``registry.tiny_cases``), and its random inputs come from
``tests/fixtures/dit_inputs.py``, by its condition model type (token counts not divisible by 2 or 4, so every SP run
pads). A new DiT spec, its condition model and its example inputs there join every suite with no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.diffusion.conditions import condition_model_class
from runtime.diffusion.registry import lookup_dit, tiny_cases, tiny_config, training_class
from tests.fixtures.dit_inputs import example_inputs


@dataclass(frozen=True)
class Case:
    """One model configuration (a spec's tiny config, or one of its variants)."""

    name: str
    model_type: str
    variant: str | None
    config: dict[str, Any]

    @property
    def upstream_class(self) -> type:
        return lookup_dit(self.model_type).upstream_class()

    @property
    def shell_class(self) -> type:
        return training_class(self.model_type)

    @property
    def condition_model_type(self) -> str:
        return lookup_dit(self.model_type).data["condition_model_type"]

    @property
    def condition_class(self) -> type:
        return condition_model_class(self.condition_model_type)


CASES = {
    name: Case(name, model_type, variant, tiny_config(model_type, variant))
    for name, (model_type, variant) in sorted(tiny_cases().items())
}


def inputs(case: Case, seed: int = 1) -> dict[str, Any]:
    """Random forward kwargs for ``case`` (never zeros), identical for a given seed."""
    return example_inputs(
        case.condition_model_type, case.config, torch.Generator().manual_seed(seed), variant=case.variant
    )


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
