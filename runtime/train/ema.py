"""An exponential moving average of the trained parameters, kept as buffers of a module so that the checkpoint
saves (and DCP reshards) it like the model: ``EMA.wrap(model)`` is what a run with EMA checkpoints.

The shadow copies have the parameters' own layout (FSDP2 shards are DTensors; the EMA update is local to each shard,
no communication). After every optimizer step ``shadow = decay * shadow + (1 - decay) * param``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["EMA"]

_SEP = "/"  # buffer names cannot contain dots; the parameter "a.b.c" is kept as "a/b/c"


class EMA(nn.Module):
    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self._params: list[tuple[str, nn.Parameter]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, param in self._params:
            self.register_buffer(name.replace(".", _SEP), param.detach().clone())

    @torch.no_grad()
    def update(self) -> None:
        for name, param in self._params:
            self.get_buffer(name.replace(".", _SEP)).lerp_(param.detach(), 1.0 - self.decay)

    def parameter_name(self, buffer_key: str) -> str:
        return buffer_key.replace(_SEP, ".")

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module a checkpoint saves: ``{"model": model, "ema": self}``."""
        return nn.ModuleDict({"model": model, "ema": self})
