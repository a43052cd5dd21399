"""How far two float32 evaluations of one computation may differ when they sum in different orders: the rounding
model every parity comparison (SP, ring, USP, EP, FSDP/HSDP, RL layouts against one process) is held to.

Model. A float32 sum of ``n`` terms carries a rounding error of order ``eps32 * sqrt(n) * sum|terms|`` (worst case
``n * eps32 * sum|terms|``), and every layer passes the error of its inputs on, scaled by its conditioning. Two
evaluations that order their sums differently (a sequence split over SP ranks, another CPU's BLAS blocking, MKL's
AVX-512 sgemm) therefore differ by an amount set by the computation, not by a fixed fraction of the result: a
gradient whose per-token terms cancel (a bias a softmax nearly ignores, a weight fed by near-constant inputs) may
differ by 1e-5 of itself or more, while a well-conditioned one differs by 1e-7.

Neither ``n`` nor ``|terms|`` is known at the comparison, so the model takes a witness of the reference's own
rounding, ``noise``, from the job itself, in one of two ways:

* ``ref32 - ref64``: the reference's float32 error against the same computation in float64 (truth up to ``eps64``):
  the suites that build the model themselves;
* ``ref32 - other32``: the reference against the same computation on kernels that sum in other orders (ATen's
  default kernels and MKL's SSE2-compatible branch, ``tests/dist_utils.start_reordered``): the suites whose runtime
  computes in float32 by design (RL: its sampler steps in float32), where no float64 run exists. This witness is the
  phenomenon itself: another CPU's or BLAS's summation order.

The bound, norm-wise over one tensor::

    ||got - ref|| <= FACTOR * ||noise|| + FLOOR_ULPS * eps32 * scale

``got - ref`` is a difference of two rounding errors of the same kind as ``noise`` (about ``sqrt(2)`` times it when
both are errors against truth, about 1 times it against another float32 order); for tensors of ``m >= 8`` elements
the ratio of two such norms exceeds ``FACTOR = 8`` with probability below 1e-5 (a tail of the F(m, m) distribution).
The model assumes both sides sum with algorithms of one class (blocked or pairwise, as every BLAS and ATen
reduction does); a naive running sum of 10^5 terms grows its error like ``n``, not ``sqrt(n)``, and is outside it. A
tensor of few elements (a loss, a bias of size 1) can meet a ``noise`` that is small by chance; the floor carries it:
``FLOOR_ULPS`` ulps of ``scale``, the magnitude of the terms the value sums (``||ref||`` unless the caller knows the
terms are larger, as for a loss whose terms cancel).

Power. A bound is useful only while it stays below the defects a comparison is for: a lost or doubled gradient
share moves a gradient by 0.5-1 relative, a split carried on the wrong argument by about 1, a rank that restarts
positions or sees only its own tokens by 1e-2 and up. ``Verdict.power`` is the bound relative to ``||ref||``;
``POWER_LIMIT`` (1e-2) is the most a comparison may allow before it must say that it cannot prove anything
(``Verdict.failure`` then names it) rather than pass; a caller may accept a weaker bound for named tensors only with
a stated reason (``tests/tolerance.py``'s ``weak``), never above ``WEAK_LIMIT`` (0.1: a lost or doubled gradient
share still shows). Where a gradient's terms cancel inside each token (a cross-attention key bias: the softmax's
derivative sums to 0 over the keys) or an RL rollout amplifies rounding (advantages standardised over a group of
near-equal rewards), the witness is large and the bound with it: the model is honest about what float32 can move
there, and the limit says how far that may go.

What a one-process witness cannot see: rounding that only the layout has. Where a layout adds up partial results far
larger than their sum (under SP, a replicated tensor's gradient is the sum of every rank's partial one, each a sum
over that rank's tokens of terms that cancel), its error exceeds any one-process run's; a second witness that splits
the same sums (one process with its micro-batches split) covers it, and each tensor takes the larger noise.

Comparisons between runs that sum in the same order (the generated class against upstream with parallelism off)
stay bitwise and do not use this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EPS32", "FACTOR", "FLOOR_ULPS", "POWER_LIMIT", "WEAK_LIMIT", "Verdict", "judge"]

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one ulp of 1.0
FACTOR = 8.0
FLOOR_ULPS = 16.0
POWER_LIMIT = 1e-2
WEAK_LIMIT = 0.1


@dataclass(frozen=True)
class Verdict:
    """One comparison under the rounding model: the error ``||got - ref||``, the bound, and the bound relative to
    ``||ref||`` (its power: the smallest relative defect it is sure to see)."""

    what: str
    error: float
    bound: float
    reference_norm: float
    power_scale: float  # what the bound's power is measured against: ||ref||, or more (``judge``'s power_scale)

    @property
    def ratio(self) -> float:
        """error / bound: <= 1 passes; the margin a passing comparison keeps is 1 / ratio."""
        return self.error / self.bound if self.bound > 0 else (0.0 if self.error == 0 else float("inf"))

    @property
    def power(self) -> float:
        return self.bound / self.power_scale if self.power_scale > 0 else 0.0

    def failure(self, power_limit: float = POWER_LIMIT) -> str | None:
        """None when ``got`` is within the bound and the bound has power (at most ``power_limit`` of the value); else
        one line saying which is not."""
        if not self.error <= self.bound:  # NaN fails too
            relative = self.error / max(self.reference_norm, 1e-300)
            return (
                f"{self.what}: differs by {self.error:.3e} (relative {relative:.2e}), {self.ratio:.1f}x the rounding"
                f" bound {self.bound:.3e}"
            )
        if self.power > power_limit:
            return (
                f"{self.what}: the rounding bound is {self.power:.2e} of the value itself (over {power_limit:g}): this"
                " comparison could not see a defect of that size; choose inputs whose terms do not cancel"
            )
        return None


def _norm(x: torch.Tensor | float) -> float:
    return torch.as_tensor(x).detach().double().norm().item()


def judge(
    what: str,
    got: torch.Tensor | float,
    ref: torch.Tensor | float,
    noise: torch.Tensor | float,
    scale: float | None = None,
    power_scale: float | None = None,
) -> Verdict:
    """``got`` against ``ref`` (same computation, another summation order) given ``noise``, a witness of the
    reference's float32 rounding (``ref32 - ref64`` or ``ref32 - other32``, see the module docstring); ``scale``:
    the magnitude of the terms the value sums, when it exceeds ``||ref||`` (terms that cancel); ``power_scale``: the
    size a defect would move, when it exceeds ``||ref||`` (a gradient that is nearly zero by structure, e.g. a key
    bias a softmax nearly ignores, is judged for power against a share of the whole gradient: a layout defect moves
    the whole, and so small a tensor cannot carry a proof by itself)."""
    got_t, ref_t, noise_t = (torch.as_tensor(x).detach().double().cpu() for x in (got, ref, noise))
    if got_t.shape != ref_t.shape:
        raise ValueError(f"{what}: shapes differ, {tuple(got_t.shape)} against {tuple(ref_t.shape)}")
    reference_norm = _norm(ref_t)
    floor = FLOOR_ULPS * EPS32 * max(reference_norm, scale or 0.0)
    bound = FACTOR * _norm(noise_t) + floor
    return Verdict(what, _norm(got_t - ref_t), bound, reference_norm, max(reference_norm, power_scale or 0.0))
