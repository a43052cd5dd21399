"""Every run proves itself before step 1: a shrunk copy of the job's own model (``self_check_shrink.py``) runs one
forward and backward under the job's exact parallel layout (the same ``parallelize`` and step code: SP, ring, EP,
FSDP/HSDP, mixed precision, checkpointing) and once in one process, and the generated class runs against its
upstream class (parallelism off, same weights); the loss and every parameter's gradient must agree within
``tolerance``. A mismatch stops the run before any step (one line, exit 2) naming the parameter, the error, the
tolerance, the layout and the key that turns the check off (``train.self_check: {enabled: false, reason: ...}``).

Why at start-up and not only in the test suite: the suite proves the tiny configs of the specs on CPU and gloo; a job
runs its own options (softcaps, biases, windows, expert routing) on its own layout, kernels and device, where a
silent defect (doubled gradient shares, attention limited to a rank's tokens, a dropped option) would otherwise
train for days before anyone saw a loss curve. The families a proof exists for are in ``PROOFS``; the others print
that the check is not available yet and go on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from runtime.config.errors import ConfigError
from runtime.parallel.full_tensors import full_tensors
from runtime.parallel.state import ParallelState

__all__ = [
    "Comparison",
    "Proof",
    "compare",
    "gradients",
    "layout_text",
    "margin",
    "power_text",
    "report",
    "together",
    "tolerance",
    "untouched_rng",
]

# fp32: the project's parity standard is 1e-5 (docs/parallelism.md, CPU gloo); the proof runs on the job's own
# kernels and device, where reductions run in other orders, and must never stop a correct run: 10x margin. The
# defects it is for (a doubled or lost gradient share, attention limited to a rank's tokens, a dropped softcap or
# bias) move gradients by 1e-2 to 1.
FP32_TOLERANCE = 1e-4
# bf16 (train.mixed_precision): the job's side computes with bf16 parameters and activations (8 bits of mantissa,
# 2**-9 = 2e-3 relative per rounding, through every layer) against the fp32 one-process run. Measured on CPU (gloo,
# world 2): worst 1.4e-2 on a dense qwen3 (dp_shard 2), 9.4e-2 on a qwen3_moe router (sp 2 x ep 2; a rounding can
# flip a token's top-k choice). 0.25 is 2.5x that, and 2x below the smallest layout defect it is for: a gradient
# share lost at sp 2 (0.5) or doubled (1.0).
BF16_TOLERANCE = 0.25
# A gradient that is zero in exact arithmetic (a key bias that softmax ignores, an expert no token reached) is
# rounding noise on both sides: measured 2e-10 of the whole gradient's norm (cogvideox's norm_k.bias at sp 2), O(1)
# relative to itself. Every gradient is therefore measured against at least 1e-3 of the whole gradient's norm: such
# noise shows as 1e-7, while a doubled or lost gradient of any parameter above 1e-7 of the whole still exceeds the
# fp32 tolerance.
ZERO_GRADIENT_FLOOR = 1e-3


def tolerance(compute_dtype: torch.dtype) -> float:
    """The relative tolerance of a proof whose job computes in ``compute_dtype`` (the constants' comments: why)."""
    return FP32_TOLERANCE if compute_dtype == torch.float32 else BF16_TOLERANCE


@dataclass(frozen=True)
class Comparison:
    """One side against the one-process reference: the loss's relative error and each parameter's."""

    what: str  # "sp 2 x ... vs one process", "generated vs upstream ..."
    loss_error: float
    errors: dict[str, float]
    tolerance: float

    def worst(self) -> tuple[str, float]:
        """(parameter, its error): the parameter whose gradient differs most; ("loss", 0.0) without any."""
        return max(self.errors.items(), key=lambda item: item[1], default=("loss", 0.0))

    def failure(self) -> str | None:
        """What is outside the tolerance, naming the parameter whenever a gradient is (NaN fails too); None if
        nothing is."""
        name, value = self.worst()
        loss = f"{self.loss_error:.2e}"
        if not value <= self.tolerance:
            return f"{name}: its gradient differs by {value:.2e} relative (the loss by {loss})"
        if not self.loss_error <= self.tolerance:
            return f"the loss differs by {loss} relative (every gradient within the tolerance)"
        return None


@dataclass(frozen=True)
class Proof:
    """What a family's proof found: its comparisons and what it ran (for the start-up line)."""

    shrunk: str  # "2 layers, hidden 64, 8 experts"
    comparisons: list[Comparison] = field(default_factory=list)
    # one per planted defect (``self_check_power.py``): each must fail, or the proof has no power on this job
    planted: list[Comparison] = field(default_factory=list)
    # planted defect classes whose regime the proof cannot set (name -> why): one it does not detect is named in the
    # line instead of refusing the run (``self_check_power.Defect.advisory``)
    advisory: dict[str, str] = field(default_factory=dict)
    # the shrunk model's sequence mixers found by behaviour (``runtime.parallel.mixers.census``; under SP only): the
    # job's model watches them at every forward whatever their class name (``runtime/parallel/sites.py``)
    mixers: tuple[str, ...] = ()


def relative(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """Norm-wise relative error ``||a - b|| / ||b||`` in fp64, the denominator at least ``floor``."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(max(floor, 1e-30))).item()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter's full gradient (sharded DTensors gathered, ``runtime.parallel.full_tensors``:
    collective, every rank in the same order), zeros where none was computed, on the CPU in fp32."""
    found, sharded = {}, {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key, grad = name.replace("_orig_mod.", ""), param.grad
        if isinstance(grad, DTensor):
            sharded[key] = grad
        found[key] = torch.zeros(param.shape) if grad is None else grad
    found.update(full_tensors(sharded))
    return {name: grad.detach().float().cpu() for name, grad in found.items()}


def compare(
    what: str,
    loss: torch.Tensor,
    grads: dict[str, torch.Tensor],
    ref_loss: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
    tol: float,
) -> Comparison:
    """``loss``/``grads`` against the reference; a parameter one side lacks is an error of 1 (as wrong as it gets)."""
    total = sum(g.double().norm().item() ** 2 for g in ref_grads.values()) ** 0.5
    floor = ZERO_GRADIENT_FLOOR * total
    errors = {
        name: relative(grads[name], ref, floor) if name in grads and grads[name].shape == ref.shape else 1.0
        for name, ref in ref_grads.items()
    }
    errors.update({name: 1.0 for name in grads.keys() - ref_grads.keys()})
    return Comparison(what, relative(loss, ref_loss), errors, tol)


def _collective_device(group: Any) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current GPU under NCCL, else the CPU."""
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def together(group: Any) -> None:
    """Return once every rank of ``group`` has called it (one all-reduce of one element). The proof's clock starts
    here: ranks reach the proof apart by whatever their start-up differed (their own data, the machine's other load:
    0.15-1.0 s measured on the 2-core box), a wait the first step's collectives pay when the proof is off; timed from
    the first rank's arrival, the start-up line charged it to the proof."""
    if group is None or not dist.is_initialized():
        return
    dist.all_reduce(torch.zeros(1, device=_collective_device(group)), group=group)


def agree(comparisons: list[Comparison], group: Any) -> list[Comparison]:
    """Every rank's comparisons replaced by the worst each error is on any rank, so that all ranks reach the same
    verdict (a rank that stopped alone would leave the others waiting in the first step's collectives)."""
    if group is None or not dist.is_initialized():
        return comparisons
    values = torch.tensor(
        [v for c in comparisons for v in (c.loss_error, *[c.errors[n] for n in sorted(c.errors)])], dtype=torch.float64
    )
    values = values.to(_collective_device(group))
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    flat, out = values.cpu().tolist(), []
    for c in comparisons:
        names = sorted(c.errors)
        loss_error, errors = flat[0], dict(zip(names, flat[1 : 1 + len(names)], strict=True))
        flat = flat[1 + len(names) :]
        out.append(Comparison(c.what, loss_error, errors, c.tolerance))
    return out


def layout_text(state: ParallelState, mixed_precision: str, dtype: torch.dtype, checkpointing: bool) -> str:
    """The job's layout in words, as the error line names it."""
    text = f"dp_replicate {state.dp_replicate_size} x dp_shard {state.dp_shard_size} x sp {state.sp_size}"
    text += f" (ulysses {state.ulysses_size} x ring {state.ring_size})" if state.ring_size > 1 else ""
    text += f", ep {state.ep_size}" if state.ep_size > 1 else ""
    text += f", {str(dtype).removeprefix('torch.')} (train.mixed_precision {mixed_precision})"
    return text + (", activation checkpointing" if checkpointing else "")


def _shown(tol: float) -> str:
    return f"{tol:.0e}" if tol < 1e-2 else f"{tol:g}"


def margin(comparison: Comparison) -> float:
    """How far outside the tolerance a planted defect landed: its largest error over the tolerance."""
    return max(comparison.loss_error, comparison.worst()[1]) / comparison.tolerance


def power_text(planted: list[Comparison], advisory: dict[str, str] | None = None) -> str:
    """The self-check line's power part: how many planted defects were caught and by what margin, and which
    advisory ones (``Proof.advisory``) it could not see on this job."""
    if not planted:
        return "power: no layout defect to plant in one process"
    advisory = advisory or {}
    missed = [c for c in planted if c.failure() is None and c.what in advisory]
    caught = [c for c in planted if c not in missed]
    count = f"power: {len(caught)} planted defect{'s' if len(caught) != 1 else ''} detected"
    finite = [margin(c) for c in caught if not math.isinf(margin(c))]
    refused = len(caught) - len(finite)
    by_check = f"{refused} by a run-time check" if refused else ""
    if not caught:
        text = count
    elif not finite:
        text = f"{count}, {'each' if refused > 1 else 'it'} refused by a run-time check"
    else:
        text = f"{count}, smallest margin {min(finite):.0f}x" + (f" ({by_check})" if refused else "")
    for c in missed:
        text += f"; not detectable on this job: {c.what} ({margin(c):.2f}x the tolerance: {advisory[c.what]})"
    return text


def report(proof: Proof, seconds: float, off_key: str) -> str:
    """The start-up line of a proof that passed; raises ``ConfigError`` (one line, exit 2) for one that did not,
    and for one without power: a planted defect it did not detect (``self_check_power.py``)."""
    for c in proof.comparisons:
        what = c.failure()
        if what is not None:
            raise ConfigError(
                f"{off_key}: the start-up self-check failed: {what}, tolerance {_shown(c.tolerance)}, in {c.what}; "
                f"this run would train wrongly. Report it with this line; {off_key}: {{enabled: false, reason: ...}} "
                "skips the check"
            )
    blind = [c for c in proof.planted if c.failure() is None and c.what not in proof.advisory]
    if blind:
        names = "; ".join(f"{c.what} (moved it by {max(c.loss_error, c.worst()[1]):.1e})" for c in blind)
        raise ConfigError(
            f"{off_key}: the start-up self-check cannot fail on this job: planted defects stayed inside the "
            f"tolerance {_shown(blind[0].tolerance)}: {names}; its shrunk model and rows do not reach what they "
            f"change, so this run's layout would be unproven. Report it with this line; "
            f"{off_key}: {{enabled: false, reason: ...}} skips the check"
        )
    parts = [f"{c.what}: loss {c.loss_error:.1e}, worst {c.worst()[0]} {c.worst()[1]:.1e}" for c in proof.comparisons]
    tol = ", ".join(_shown(t) for t in sorted({c.tolerance for c in proof.comparisons}))
    power = power_text(proof.planted, proof.advisory)
    return f"self-check: passed in {seconds:.2f} s ({proof.shrunk}; {'; '.join(parts)}; tolerance {tol}; {power})"


@contextmanager
def untouched_rng(device: torch.device):
    """The proof draws its own weights and tokens; the job's random streams (dropout, init) continue as if it had
    not run, so a run with the check and one without train identically."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def run_proof(prove: Callable[[], Proof], off_key: str, say: Callable[[str], None], group: Any) -> Proof:
    """Run ``prove`` once every rank of ``group`` (the world) has arrived (``together``: the seconds the line
    reports are the proof's own), agree on its errors over ``group``, print the start-up line or raise; the proof."""
    together(group)
    started = time.perf_counter()
    proof = prove()
    proof = replace(proof, comparisons=agree(proof.comparisons, group), planted=agree(proof.planted, group))
    say(report(proof, time.perf_counter() - started, off_key))
    return proof
