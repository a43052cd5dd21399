"""Flow-matching noise levels for DiT training, as each model's training recipe draws them.

A draw ``u`` in (0, 1) comes from ``uniform`` or ``logit_normal`` (sigmoid of a normal: SD3/Flux-style weighting
towards the middle), then is shifted towards noise:

* ``shift``: ``sigma = s u / (1 + (s - 1) u)`` (Wan: the scheduler's ``shift`` / ``flow_shift``, e.g. 5.0);
* ``dynamic``: resolution-dependent, ``mu`` linear in the image token count between (``base_seq_len``,
  ``base_shift``) and (``max_seq_len``, ``max_shift``), ``sigma = e^mu / (e^mu + 1/u - 1)`` (Flux, Qwen-Image:
  the ``use_dynamic_shifting`` scheduler settings their pipelines sample with).

The noisy input is ``(1 - sigma) x0 + sigma noise`` and the target ``noise - x0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["TimestepSampler"]


@dataclass(frozen=True)
class TimestepSampler:
    distribution: Literal["uniform", "logit_normal"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    dynamic: bool = False
    base_seq_len: int = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    def __post_init__(self) -> None:
        if self.distribution not in ("uniform", "logit_normal"):
            raise ValueError(f"timestep distribution must be 'uniform' or 'logit_normal', got {self.distribution!r}")
        if self.shift <= 0:
            raise ValueError(f"timestep shift must be > 0, got {self.shift}")

    @classmethod
    def from_scheduler_config(cls, config: Mapping[str, Any], **overrides: Any) -> TimestepSampler:
        """The shift settings of a pipeline's scheduler config (``shift`` or UniPC's ``flow_shift``;
        ``use_dynamic_shifting`` with its ``base/max_image_seq_len`` and ``base/max_shift``)."""
        dynamic = bool(config.get("use_dynamic_shifting", False))
        shift = config.get("shift", None)
        if shift is None:
            shift = config.get("flow_shift", None)
        values: dict[str, Any] = {"dynamic": dynamic, "shift": float(1.0 if shift is None or dynamic else shift)}
        for ours, theirs in (
            ("base_seq_len", "base_image_seq_len"),
            ("max_seq_len", "max_image_seq_len"),
            ("base_shift", "base_shift"),
            ("max_shift", "max_shift"),
        ):
            if config.get(theirs) is not None:
                values[ours] = config[theirs]
        return cls(**{**values, **overrides})

    def mu(self, seq_len: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return self.base_shift + slope * (seq_len - self.base_seq_len)

    def sample(self, batch: int, seq_len: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
        """``batch`` noise levels sigma in (0, 1), float32; ``seq_len`` (image tokens) matters for ``dynamic``."""
        if self.distribution == "logit_normal":
            u = torch.sigmoid(torch.randn(batch, generator=generator) * self.logit_std + self.logit_mean)
        else:
            u = torch.rand(batch, generator=generator)
        u = u.double().clamp(1e-6, 1 - 1e-6)
        if self.dynamic:
            e = math.exp(self.mu(seq_len))
            sigma = e / (e + (1 / u - 1))
        else:
            sigma = self.shift * u / (1 + (self.shift - 1) * u)
        return sigma.float()
