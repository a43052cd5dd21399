"""Argument normalisation for generated processors (templates ``processor/none_if_empty``, ``processor/kwarg_alias``).

Upstream processors test their media inputs with ``is not None``: an empty list (a batch without images, as chat
pipelines naturally produce) still runs the image processor on nothing and fails. Processors also disagree on the
keyword for audio (``audio=`` here, ``audios=`` in others), so callers written for one break on the other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["none_if_empty", "take_alias"]


def _empty(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(_empty(item) for item in value)


def none_if_empty(value: Any) -> Any:
    """None for an empty list/tuple or a list of empty lists (one per sample); anything else unchanged."""
    return None if _empty(value) else value


def take_alias(value: Any, kwargs: dict[str, Any], name: str, alias: str) -> Any:
    """``value``, or ``kwargs.pop(alias)`` when only the alias was given; TypeError when both were."""
    if alias not in kwargs:
        return value
    other = kwargs.pop(alias)
    if value is not None and other is not None:
        raise TypeError(f"got both {name}= and {alias}= (the same input); pass one of them")
    return other if value is None else value
