"""Flow-matching noise levels for DiT training, as each model's training recipe draws them.

A draw ``u`` in (0, 1) comes from ``uniform`` or ``logit_normal`` (sigmoid of a normal: SD3/Flux-style weighting
towards the middle), then is shifted towards noise:

* ``shift``: ``sigma = s u / (1 + (s - 1) u)`` (Wan: the scheduler's ``shift`` / ``flow_shift``, e.g. 5.0);
* ``dynamic``: resolution-dependent, ``mu`` linear in the image token count between (``base_seq_len``,
  ``base_shift``) and (``max_seq_len``, ``max_shift``), ``sigma = e^mu / (e^mu + 1/u - 1)`` (Flux, Qwen-Image:
  the ``use_dynamic_shifting`` scheduler settings their pipelines sample with).

The noisy input is ``(1 - sigma) x0 + sigma noise`` and the target ``noise - x0``.

Loss weighting (``weighting``; the per-sample factor on the flow-matching MSE, ``loss_weight(sigmas)``):

* ``none``: 1 (diffusers' Flux and Qwen-Image training scripts: the logit-normal density does the weighting);
* ``bell``: a Gaussian bump over the noise level centred at sigma = 0.5, ``exp(-2 (sigma - 0.5)^2)`` minus its
  value at the ends (so sigma = 0 and 1 weigh 0), scaled to mean 1 under this sampler's own distribution of sigma
  (DiffSynth-Studio's Wan recipe weights its MSE by this bump over the timestep, normalised over its training grid).

Range (``low``, ``high``: noise levels in [0, 1]): levels drawn from this distribution conditioned on
``low <= sigma < high`` (uniform ``u`` over the preimage of the range under the static shift), e.g. one expert of a
pipeline whose two transformers switch at ``boundary_ratio`` (Wan2.2 A14B: ``transformer`` at
``sigma >= boundary_ratio``, ``transformer_2`` below); the bell weighting is normalised over the range.

Generators: ``sample`` takes one generator for the whole batch, or one per sample (a sequence of ``batch``
generators: each sample's level comes from its own generator), so a sample's draw does not depend on which other
samples share its micro-batch or rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["WEIGHTINGS", "TimestepSampler"]

WEIGHTINGS = ("none", "bell")
_GRID = 1000  # points of the quadrature that normalises the bell weighting to mean 1


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
    weighting: Literal["none", "bell"] = "none"
    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ValueError(f"timestep range must satisfy 0 <= low < high <= 1, got [{self.low}, {self.high})")
        if (self.low, self.high) != (0.0, 1.0) and (self.distribution != "uniform" or self.dynamic):
            raise ValueError(
                "a timestep range (one expert's noise levels) needs the uniform distribution with a static shift"
            )
        if self.distribution not in ("uniform", "logit_normal"):
            raise ValueError(f"timestep distribution must be 'uniform' or 'logit_normal', got {self.distribution!r}")
        if self.shift <= 0:
            raise ValueError(f"timestep shift must be > 0, got {self.shift}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"loss weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")

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

    def _u_range(self) -> tuple[float, float]:
        """The draws ``u`` whose static-shifted level lies in [low, high): the shift's inverse at both ends."""

        def inverse(sigma: float) -> float:
            return sigma / (self.shift - (self.shift - 1) * sigma)

        return inverse(self.low), inverse(self.high)

    def _draw(self, batch: int, generator: torch.Generator | None) -> torch.Tensor:
        if self.distribution == "logit_normal":
            return torch.sigmoid(torch.randn(batch, generator=generator) * self.logit_std + self.logit_mean)
        u = torch.rand(batch, generator=generator)
        if (self.low, self.high) == (0.0, 1.0):
            return u
        lo, hi = self._u_range()
        return lo + (hi - lo) * u.double()

    def _shifted(self, u: torch.Tensor, seq_len: int) -> torch.Tensor:
        u = u.double().clamp(1e-6, 1 - 1e-6)
        if self.dynamic:
            e = math.exp(self.mu(seq_len))
            return e / (e + (1 / u - 1))
        return self.shift * u / (1 + (self.shift - 1) * u)

    def sample(
        self,
        batch: int,
        seq_len: int = 0,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """``batch`` noise levels sigma in (0, 1), float32; ``seq_len`` (image tokens) matters for ``dynamic``.

        ``generator``: one for the batch, or a sequence of ``batch`` generators (one draw from each)."""
        if isinstance(generator, Sequence):
            if len(generator) != batch:
                raise ValueError(f"{len(generator)} generators for a batch of {batch}")
            u = torch.cat([self._draw(1, g) for g in generator]) if batch else torch.zeros(0)
        else:
            u = self._draw(batch, generator)
        sigmas = self._shifted(u, seq_len).float()
        if (self.low, self.high) != (0.0, 1.0):  # rounding to float32 never leaves the range (an expert's levels)
            high = torch.tensor(self.high, dtype=torch.float32)
            below = torch.nextafter(high, torch.tensor(0.0)) if self.high < 1 else high
            sigmas = sigmas.clamp(torch.tensor(self.low, dtype=torch.float32), below)
        return sigmas

    def loss_weight(self, sigmas: torch.Tensor, seq_len: int = 0) -> torch.Tensor:
        """The per-sample factor of the flow-matching MSE at noise levels ``sigmas`` (float32, ``sigmas``' shape)."""
        if self.weighting == "none":
            return torch.ones_like(sigmas, dtype=torch.float32)
        # bell: normalised to mean 1 over this sampler's distribution (midpoint quadrature of the draw u)
        grid = (torch.arange(_GRID, dtype=torch.float64) + 0.5) / _GRID
        if (self.low, self.high) != (0.0, 1.0):
            lo, hi = self._u_range()
            grid = lo + (hi - lo) * grid
        if self.distribution == "logit_normal":  # u = sigmoid(normal): the grid is over the normal's quantiles
            normal = torch.distributions.Normal(self.logit_mean, self.logit_std)
            grid = torch.sigmoid(normal.icdf(grid))
        mean = _bell(self._shifted(grid, seq_len)).mean()
        return (_bell(sigmas.double()) / mean).float()


def _bell(sigma: torch.Tensor) -> torch.Tensor:
    return torch.exp(-2 * (sigma - 0.5) ** 2) - math.exp(-0.5)
