"""The one comparison every layout-parity suite makes: a layout's results against one process's under the rounding
model of ``runtime/rounding.py`` (docs/parallelism.md, "Tolerances"), every tensor at once.

A result is a dict of tensors or floats, nested one level at most (``{"loss": ..., "logits": ..., "grads": {name:
tensor}}``); ``flatten`` names each leaf ``grads.<name>``, and the leaves of one nested dict are a group (a leaf far
below its group's norm is near zero by structure, see ``GRADIENT_SHARE``). ``witness`` is the same computation as the
reference in float64 (the suites that build the model themselves) or on kernels that sum in other orders
(``tests.dist_utils.start_reordered``: the RL and trainer suites, whose runtimes compute in float32 by design);
``ref - witness`` is the noise ``runtime.rounding.judge`` scales its bound by.

``ROUNDING_REPORT=<file>``: every comparison appends a JSON line (case, name, relative error, bound relative to the
value, error / bound) to ``<file>``: the margins docs/parallelism.md reports (``python -m tests.rounding_report``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from runtime.rounding import POWER_LIMIT, WEAK_LIMIT, judge

__all__ = ["GRADIENT_SHARE", "assert_steps_within_rounding", "assert_within_rounding", "flatten", "references"]

# 1e-3 of the whole gradient's norm: the scale below which a gradient is near zero by structure (a key bias that a
# softmax ignores): its floor (FLOOR_ULPS ulps of this share) and its power are measured against the share. A layout
# defect moves the whole gradient by 1e-2 and more, so a bound within 1e-2 of this share still sees it.
GRADIENT_SHARE = 1e-3


def flatten(result: Mapping[str, Any], keys: Iterable[str] | None = None) -> dict[str, Any]:
    """``result``'s leaves (tensors, floats, None) by dotted name; ``keys``: only these top-level keys."""
    out: dict[str, Any] = {}
    for key in result if keys is None else keys:
        value = result[key]
        if isinstance(value, Mapping):
            out.update({f"{key}.{name}": leaf for name, leaf in value.items()})
        else:
            out[key] = value
    return out


def _as_tensor(value: Any) -> torch.Tensor:
    return torch.as_tensor(value).detach().double().cpu()


def assert_within_rounding(
    got: Mapping[str, Any],
    ref: Mapping[str, Any],
    witness: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    keys: Iterable[str] | None = None,
    scale: Mapping[str, float] | None = None,
    what: str = "",
    weak: tuple[tuple[str, str], ...] = (),
) -> None:
    """Every leaf of ``got`` within the rounding bound of ``ref``'s, the noise being ``ref - witness`` (see the module
    docstring; of several witnesses, each tensor's largest); ``scale``: a leaf's terms' magnitude where they cancel
    (by flattened name). A leaf that is None in ``ref`` (a parameter upstream leaves out of the loss) must be None or
    exactly zero in ``got``. ``weak``: (name
    fragment, reason) pairs whose tensors may have a bound up to ``WEAK_LIMIT`` of their value (the reason says why
    float32 cannot do better on the test's inputs); the others are held to ``POWER_LIMIT``. Every failure is reported
    in one assertion, prefixed by ``what`` (the case)."""
    if any(not reason.strip() for _, reason in weak):
        raise ValueError("weak: every accepted weaker bound needs its reason")
    witnesses = [flatten(w, keys) for w in ([witness] if isinstance(witness, Mapping) else witness)]
    got_flat, ref_flat = flatten(got, keys), flatten(ref, keys)
    assert all(got_flat.keys() == ref_flat.keys() == w.keys() for w in witnesses), (
        f"{what}: the results name other tensors: only in got {sorted(got_flat.keys() - ref_flat.keys())}, only in"
        f" the reference {sorted(ref_flat.keys() - got_flat.keys())}"
    )
    # a leaf of a group (the gradients) below GRADIENT_SHARE of the group's norm is near zero by structure: its value
    # is rounding noise of terms the size of the group's, so its floor and its power come from that share
    shares: dict[str, float] = {}
    for group in {name.split(".", 1)[0] for name in ref_flat if "." in name}:
        leaves = [_as_tensor(v) for n, v in ref_flat.items() if n.startswith(group + ".") and v is not None]
        shares[group] = GRADIENT_SHARE * float(torch.stack([t.norm() for t in leaves]).norm()) if leaves else 0.0
    failures, verdicts = [], []
    for name, value in ref_flat.items():
        if value is None:
            other = got_flat[name]
            if other is not None and bool(_as_tensor(other).ne(0).any()):
                failures.append(f"{name}: None in the reference (no gradient), non-zero here")
            continue
        reference = _as_tensor(value)
        noise = max((reference - _as_tensor(w[name]) for w in witnesses), key=lambda n: float(n.norm()))
        share = shares.get(name.split(".", 1)[0], 0.0) if "." in name else 0.0
        floor_scale = max((scale or {}).get(name) or 0.0, share)
        power_scale = share
        verdict = judge(name, _as_tensor(got_flat[name]), reference, noise, floor_scale, power_scale)
        verdicts.append(verdict)
        limit = WEAK_LIMIT if any(fragment in name for fragment, _ in weak) else POWER_LIMIT
        if (failure := verdict.failure(limit)) is not None:
            failures.append(failure)
    if report := os.environ.get("ROUNDING_REPORT"):
        with open(report, "a") as out:
            for v in verdicts:
                line = {"case": what, "name": v.what, "relative": v.error / max(v.reference_norm, 1e-300)}
                out.write(json.dumps(line | {"power": v.power, "ratio": v.ratio}) + "\n")
    assert not failures, f"{what}: {len(failures)} outside the rounding model:\n" + "\n".join(failures)


def _run_cases(rank: int, world_size: int, run: Callable[..., Any], cases: list[tuple]) -> list[Any]:
    return [run(*case) for case in cases]


def references(run: Callable[..., Any], cases: list[tuple]) -> tuple[list[Any], list[Any]]:
    """``run(*case)`` of every case in this process (the references) and on a rank whose kernels sum in other orders
    (the witnesses, ``tests.dist_utils.start_reordered``; computed alongside). ``run`` must be module-level."""
    from tests.dist_utils import start_reordered

    pending = start_reordered(_run_cases, run, list(cases))
    refs = [run(*case) for case in cases]
    return refs, pending()


def assert_steps_within_rounding(
    got: list[tuple[float, float]], ref: list[tuple[float, float]], witness: list[tuple[float, float]], what: str
) -> None:
    """A trainer's per-step (loss, grad norm) against one process's, each series as one tensor (the later steps
    carry the optimizer's amplification of every earlier difference, and so does the witness's)."""
    assert len(got) == len(ref) == len(witness), (what, len(got), len(ref), len(witness))

    def series(steps: list[tuple[float, float]]) -> dict[str, torch.Tensor]:
        values = torch.tensor(steps, dtype=torch.float64).reshape(len(steps), 2)
        return {"loss": values[:, 0], "grad_norm": values[:, 1]}

    assert_within_rounding(series(got), series(ref), series(witness), what=what)
