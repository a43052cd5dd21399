"""What a suite that runs every spec at sp, ring or ep > 1 asks of each generated class: ``require`` (or, for a suite
that runs all its cases in one spawn, ``supporting`` to keep the runnable ones plus a ``require`` test per model).

A class that lacks a capability is skipped only with the reason its spec states (``[model.unsupported]``, quoted);
one whose spec states no reason fails, naming the key to add: a missing capability is never skipped silently.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from runtime.models import registry

CAPABILITIES = ("sp", "ring", "ep")


def _has(supports: registry.Supports, capability: str) -> bool:
    if capability not in CAPABILITIES:
        raise ValueError(f"capability {capability!r}: expected one of {list(CAPABILITIES)}")
    return {"sp": supports.sp, "ring": supports.sp and supports.ring, "ep": supports.ep}[capability]


def has(model_type: str, capability: str) -> bool:
    """Whether ``model_type``'s generated class runs at ``capability`` > 1 (a ring needs SP too)."""
    return _has(registry.REGISTRY[model_type].supports, capability)


def supporting(model_types: Iterable[str], *capabilities: str) -> list[str]:
    """The given model types whose class has every one of ``capabilities`` (the others: see ``require``)."""
    return [m for m in model_types if all(has(m, c) for c in capabilities)]


def require(model_type: str, capability: str) -> None:
    """Return when ``model_type``'s class supports ``capability`` (``sp``, ``ring``, ``ep``); skip quoting its spec's
    reason when the spec states one; fail when it states none."""
    entry = registry.REGISTRY[model_type]
    supports = entry.supports
    if _has(supports, capability):
        return
    spec = f"specs/{entry.spec}.toml"
    reason = supports.unsupported.get(capability)
    if reason is None and capability == "ring" and not supports.sp:  # no ring without SP: the SP reason covers it
        reason = supports.unsupported.get("sp")
    if reason:
        pytest.skip(f"{spec}: no {capability}: {reason}")
    key = "sp" if capability == "ring" and not supports.sp else capability
    pytest.fail(
        f"{spec}: the generated class of {model_type!r} lacks {capability} (its patches provide none) and the spec "
        f'states no reason: add [model.unsupported] {key} = "<why>" to {spec}, or the patches',
        pytrace=False,
    )


def needs(layout: dict[str, int]) -> tuple[str, ...]:
    """The capabilities an ``init_parallel_state`` layout (``sp_size``, ``ring_size``, ``ep_size``) asks for."""
    return tuple(c for c in CAPABILITIES if layout.get(f"{c}_size", 1) > 1)
