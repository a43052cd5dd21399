"""``NonDiffusersModelBase``: what the Flow-GRPO trainer needs from a denoiser that is not a diffusers model.

A subclass is an ``nn.Module`` built from one JSON-serialisable ``config`` dict (``__init__(self, config)``) that
lists its repeated blocks in ``_no_split_modules`` (the FSDP wrap units) and routes each block call through
``self.maybe_checkpoint(block, *args)``. It then gets:

* LoRA through peft: ``add_adapter(LoraConfig, name)``, ``set_adapter``, ``enable_adapters`` / ``disable_adapters``
  (disabled = the base model's computation exactly), ``save_adapter`` / ``load_adapter``
  (``adapter_config.json`` + ``adapter_model.safetensors``, peft's file names), ``adapter_state_dict``.
* Gradient checkpointing (``gradient_checkpointing_enable/disable``), non-reentrant, active only while autograd
  records (under ``torch.no_grad`` -- rollout, reference model -- blocks run plainly).
* ``save_pretrained(dir)`` / ``from_pretrained(dir)``: ``config.json`` (the config plus ``_class_name``) and
  ``model.safetensors`` with the BASE weights under their original names (LoRA layers are saved by
  ``save_adapter``; ``merge_adapters=True`` folds the active adapters into the saved base weights instead); a
  subclass whose checkpoints come in another format overrides ``read_weights`` (BAGEL's ``ema.safetensors``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from peft import LoraConfig, PeftConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

__all__ = ["NonDiffusersModelBase", "CONFIG_NAME", "WEIGHTS_NAME", "ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME"]


class NonDiffusersModelBase(nn.Module):
    _no_split_modules: ClassVar[list[str]] = []
    _supports_gradient_checkpointing: ClassVar[bool] = True

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        json.dumps(config)  # fail early: the config must round-trip through config.json
        self.config = dict(config)
        self.gradient_checkpointing = False
        self._adapter_configs: dict[str, PeftConfig] = {}

    # ----------------------------------------------------------------- gradient checkpointing
    def gradient_checkpointing_enable(self) -> None:
        if not self._supports_gradient_checkpointing:
            raise ValueError(f"{type(self).__name__} does not support gradient checkpointing")
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    def maybe_checkpoint(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, recomputed in backward when checkpointing is on and autograd is recording."""
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)

    # ----------------------------------------------------------------- LoRA (peft)
    @property
    def adapter_names(self) -> list[str]:
        return list(self._adapter_configs)

    def _tuner_layers(self) -> list[BaseTunerLayer]:
        return [m for m in self.modules() if isinstance(m, BaseTunerLayer)]

    def add_adapter(self, adapter_config: PeftConfig, adapter_name: str = "default") -> None:
        if adapter_name in self._adapter_configs:
            raise ValueError(f"adapter {adapter_name!r} already exists")
        inject_adapter_in_model(copy.deepcopy(adapter_config), self, adapter_name=adapter_name)
        self._adapter_configs[adapter_name] = adapter_config
        self.set_adapter(adapter_name)

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        missing = [n for n in names if n not in self._adapter_configs]
        if missing:
            raise ValueError(f"unknown adapter(s) {missing}; have {self.adapter_names}")
        for layer in self._tuner_layers():
            layer.set_adapter(names)

    def _require_adapters(self) -> list[BaseTunerLayer]:
        layers = self._tuner_layers()
        if not layers:
            raise ValueError(f"{type(self).__name__} has no adapters; call add_adapter or load_adapter first")
        return layers

    def enable_adapters(self) -> None:
        for layer in self._require_adapters():
            layer.enable_adapters(True)

    def disable_adapters(self) -> None:
        for layer in self._require_adapters():
            layer.enable_adapters(False)

    def adapter_state_dict(self, adapter_name: str = "default") -> dict[str, torch.Tensor]:
        if adapter_name not in self._adapter_configs:
            raise ValueError(f"unknown adapter {adapter_name!r}; have {self.adapter_names}")
        return get_peft_model_state_dict(self, adapter_name=adapter_name)

    def save_adapter(self, save_directory: str | os.PathLike, adapter_name: str = "default") -> None:
        os.makedirs(save_directory, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.adapter_state_dict(adapter_name).items()}
        save_file(state, os.path.join(save_directory, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        self._adapter_configs[adapter_name].save_pretrained(str(save_directory))

    def load_adapter(self, load_directory: str | os.PathLike, adapter_name: str = "default") -> None:
        adapter_config = LoraConfig.from_pretrained(str(load_directory))
        state = load_file(os.path.join(load_directory, ADAPTER_WEIGHTS_NAME))
        self.add_adapter(adapter_config, adapter_name)
        result = set_peft_model_state_dict(self, state, adapter_name=adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"adapter {adapter_name!r} in {load_directory} has unexpected keys: {unexpected[:5]}")

    # ----------------------------------------------------------------- save / load
    def base_state_dict(self, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
        """The state dict under the module's original (pre-LoRA) names, adapter weights left out."""
        out = {}
        for key, value in self.state_dict().items():
            if ".lora_" in key or key.startswith("lora_"):
                continue
            out[key.replace(".base_layer.", ".")] = value.detach().cpu().clone().contiguous()
        if merge_adapters:
            # out of place: merging then unmerging in place would not restore the live weights bitwise
            for name, layer in self.named_modules():
                if not isinstance(layer, BaseTunerLayer) or layer.disable_adapters:
                    continue
                key = f"{name}.weight"
                for adapter in layer.active_adapters:
                    delta = layer.get_delta_weight(adapter).detach().cpu()
                    out[key] = (out[key] + delta.to(out[key].dtype)).contiguous()
        return out

    def save_pretrained(self, save_directory: str | os.PathLike, merge_adapters: bool = False) -> None:
        os.makedirs(save_directory, exist_ok=True)
        config = {"_class_name": type(self).__name__, **self.config}
        with open(os.path.join(save_directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file(
            self.base_state_dict(merge_adapters), os.path.join(save_directory, WEIGHTS_NAME), metadata={"format": "pt"}
        )

    @classmethod
    def from_pretrained(
        cls, load_directory: str | os.PathLike, torch_dtype: torch.dtype | None = None
    ) -> NonDiffusersModelBase:
        with open(os.path.join(load_directory, CONFIG_NAME)) as f:
            config = json.load(f)
        name = config.pop("_class_name", cls.__name__)
        if name != cls.__name__:
            raise ValueError(f"{load_directory} holds a {name}, not a {cls.__name__}")
        model = cls(config)
        model.load_state_dict(cls.read_weights(load_directory), strict=True)
        if torch_dtype is not None:
            model.to(torch_dtype)
        return model

    @classmethod
    def read_weights(cls, load_directory: str | os.PathLike) -> dict[str, torch.Tensor]:
        """The base weights of a checkpoint directory under this class's names (a subclass reads its own format)."""
        return load_file(os.path.join(load_directory, WEIGHTS_NAME))
