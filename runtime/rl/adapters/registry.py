"""Diffusion model adapters of the RL job, and their registry keyed by architecture.

An adapter (a ``DiffusionModelBase`` subclass) tells the trainers and the rollout how to drive one architecture
(the trainable module is built by the job that loads it): build the scheduler and the step
schedule, turn a batch into the module's inputs, and run one denoising step that returns the step policy's
log-prob. Rollout and training call the same ``forward_and_sample_previous_step``, which is what makes their
log-probs agree.

    @register_diffusion_model("SD3Transformer2DModel")
    class SD3FlowGRPO(DiffusionModelBase): ...

    cls = get_diffusion_model_cls("SD3Transformer2DModel")

Why by architecture alone: what varies between adapters is how a model is driven (its schedule, inputs, guidance);
what varies between algorithms (the SDE type, the noise level, the CPS log-prob) reaches the adapter as its
constructor's and step's arguments. Keyed by ``(architecture, algorithm)`` every algorithm needed its own copy of
every registration, and an architecture registered for one algorithm was refused for the others.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from runtime.rl.sampling.scheduler import CpsLogProb, SdeMethod, sde_step

__all__ = [
    "DiffusionModelBase",
    "VelocityAdapter",
    "register_diffusion_model",
    "get_diffusion_model_cls",
    "is_registered",
    "registered_diffusion_models",
    "unregister_diffusion_model",
]


class DiffusionModelBase(abc.ABC):
    """The hooks one architecture's adapter implements. Set by the registry: ``architecture``."""

    architecture: str = ""

    @abc.abstractmethod
    def build_scheduler(self, config: Any) -> Any:
        """The scheduler whose sigma conventions the steps follow (e.g. ``FlowMatchEulerDiscreteScheduler``)."""

    @abc.abstractmethod
    def set_timesteps(self, num_inference_steps: int, **kwargs: Any) -> Any:
        """The step schedule (a ``runtime.rl.sampling.scheduler.FlowMatchSchedule``), built by ``make_schedule``."""

    @abc.abstractmethod
    def prepare_model_inputs(self, batch: dict[str, Any], latents: torch.Tensor, step_index: Any) -> dict[str, Any]:
        """The module's keyword arguments for one step (conditioning, timestep, CFG duplication...)."""

    @abc.abstractmethod
    def forward_and_sample_previous_step(
        self, module: nn.Module, batch: dict[str, Any], latents: torch.Tensor, step_index: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the module at ``step_index`` and take the SDE step; returns
        ``(log_prob, prev_sample_mean, std_dev_t, sqrt_dt)``. With ``prev_sample=`` given it scores that sample
        (training); otherwise it samples one, which an implementation may also expose (rollout). ``velocity=``
        (training): the module's velocity there, already computed (``VelocityAdapter.step``)."""


_REGISTRY: dict[str, type[DiffusionModelBase]] = {}


class VelocityAdapter(DiffusionModelBase):
    """An adapter whose model predicts a flow velocity: the SDE step is shared, only `velocity` differs.

    Subclasses set `noise_level` and `method` and implement `velocity(module, batch, latents, step_index)`;
    `cps_log_prob` is the CPS log-prob convention (`runtime.rl.sampling.scheduler`; verl-omni's by default).
    """

    noise_level: float
    method: SdeMethod
    cps_log_prob: CpsLogProb = "squared_error"

    @abc.abstractmethod
    def velocity(
        self, module: nn.Module, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> torch.Tensor: ...

    def step(
        self,
        module: nn.Module,
        batch: dict[str, Any],
        latents: torch.Tensor,
        step_index: int | torch.Tensor,
        *,
        noise_level: float | torch.Tensor | None = None,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        velocity: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model forward + SDE step: ``(prev_sample, log_prob, prev_sample_mean, std_dev_t, sqrt_dt)``. ``velocity``:
        the module's velocity at ``(latents, step_index)`` already computed (a caller that also needs it: one
        forward)."""
        v = self.velocity(module, batch, latents, step_index) if velocity is None else velocity
        return sde_step(
            batch["schedule"],
            latents,
            v,
            step_index=step_index,
            noise_level=self.noise_level if noise_level is None else noise_level,
            method=self.method,
            prev_sample=prev_sample,
            generator=generator,
            cps_log_prob=self.cps_log_prob,
        )

    def forward_and_sample_previous_step(
        self,
        module: nn.Module,
        batch: dict[str, Any],
        latents: torch.Tensor,
        step_index: int | torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        _, log_prob, mean, std_dev_t, sqrt_dt = self.step(module, batch, latents, step_index, **kwargs)
        return log_prob, mean, std_dev_t, sqrt_dt


def register_diffusion_model(architecture: str) -> Callable[[type[DiffusionModelBase]], type[DiffusionModelBase]]:
    """Class decorator registering the adapter of ``architecture`` (every algorithm's); a taken key raises."""

    def deco(cls: type[DiffusionModelBase]) -> type[DiffusionModelBase]:
        if not (isinstance(cls, type) and issubclass(cls, DiffusionModelBase)):
            raise TypeError(f"{cls!r} is not a DiffusionModelBase subclass")
        if architecture in _REGISTRY and _REGISTRY[architecture] is not cls:
            raise ValueError(f"{architecture!r} is already registered to {_REGISTRY[architecture].__qualname__}")
        cls.architecture = architecture
        _REGISTRY[architecture] = cls
        return cls

    return deco


def is_registered(architecture: str) -> bool:
    """Whether ``architecture`` has an adapter (without loading the built-in ones)."""
    return architecture in _REGISTRY


def unregister_diffusion_model(architecture: str) -> None:
    """Drop ``architecture``'s adapter (tests registering a toy one)."""
    _REGISTRY.pop(architecture, None)


def registered_diffusion_models() -> list[str]:
    """The architectures with an adapter, the built-in ones loaded."""
    _load_builtin_adapters()
    return sorted(_REGISTRY)


# Modules whose import registers the built-in adapters; imported on the first lookup (keeps diffusers lazy). A module
# may also define register_adapters(), called after its import: the generated DiTs come last, so an architecture with
# an adapter of its own (SD3's) keeps it.
_BUILTIN_ADAPTER_MODULES = ("runtime.rl.adapters.sd3", "runtime.rl.adapters.bagel.adapter", "runtime.rl.adapters.dit")
_builtins_loaded = False


def _load_builtin_adapters() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for name in _BUILTIN_ADAPTER_MODULES:
            register = getattr(importlib.import_module(name), "register_adapters", None)
            if register is not None:
                register()


def get_diffusion_model_cls(architecture: str) -> type[DiffusionModelBase]:
    """The adapter of ``architecture`` (for every algorithm); ``KeyError`` listing the registered ones otherwise."""
    _load_builtin_adapters()
    try:
        return _REGISTRY[architecture]
    except KeyError:
        known = ", ".join(map(repr, registered_diffusion_models())) or "none"
        message = f"no diffusion model registered for architecture={architecture!r}; registered: {known}"
        raise KeyError(message) from None
