"""How large a run config may be once loaded: the limits of the file loader (``runtime/config/yaml_file.py``) and
of command-line overrides (``runtime/config/overrides.py``) alike. A run config is a page of YAML: anything deeper or
larger is not one, and an alias bomb is a few lines that expand to billions of values."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_CONFIG_DEPTH", "MAX_CONFIG_VALUES", "shape_problem"]

MAX_CONFIG_DEPTH = 32
MAX_CONFIG_VALUES = 100_000


def shape_problem(value: Any) -> str | None:
    """What is wrong with the shape of a loaded config: mappings and lists nested more than ``MAX_CONFIG_DEPTH``
    levels, or more than ``MAX_CONFIG_VALUES`` values once YAML aliases are expanded (an alias bomb is a few lines
    that expand to billions). Stops counting at the limits."""
    count, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            return f"more than {MAX_CONFIG_VALUES} values once its aliases are expanded, the limit for a run config"
        if isinstance(item, dict | list):
            if level > MAX_CONFIG_DEPTH:
                return f"nested more than {MAX_CONFIG_DEPTH} levels deep, the limit for a run config"
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return None
