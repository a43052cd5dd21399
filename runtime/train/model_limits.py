"""Bounds on the model sizes a run may ask for, checked before the model is built.

A zero, negative or enormous size in ``model.config`` (or in a DiT's ``transformer/config.json``) otherwise fails
deep in the modeling code with a traceback (zero heads: a division by zero), exhausts the machine, or never finishes
building (a billion layers). The rules:

- every integer size key is in ``[1, MAX_SIZE]`` and every layer count in ``[1, MAX_LAYERS]`` (sub-config mappings
  included). A size key is a name ending in ``_size``, ``_dim``, ``_heads``, ``_experts`` or ``_layers``, or
  starting with ``num_``, or ``depth``; a layer count is one ending in ``_layers``, or ``depth``. Real models are
  far inside both (hidden sizes up to ~2**15, vocabularies up to ~2**18, up to ~200 layers).
- ``num_key_value_heads`` divides ``num_attention_heads`` (grouped-query attention repeats each KV head).
- a random init fits the machine: every rank builds the whole model in fp32 in host memory before FSDP shards it, so
  4 bytes x its parameter count (counted on a meta-device build, which allocates nothing) must not exceed the
  physical memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

MAX_SIZE = 2**20
MAX_LAYERS = 1024
FP32_BYTES = 4
# Integer keys that look like sizes but are thresholds or indices, where 0 is meaningful.
_NOT_SIZES = frozenset({"max_window_layers"})


def size_kind(name: str) -> str | None:
    """``"layers"`` for a layer count, ``"size"`` for another size or count, None for any other key."""
    if name in _NOT_SIZES:
        return None
    if name.endswith("_layers") or name == "depth":
        return "layers"
    if name.startswith("num_") or name.endswith(("_size", "_dim", "_heads", "_experts")):
        return "size"
    return None


def size_problems(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Every size key of ``values`` (nested mappings included) outside its bounds, as (dotted key, what is wrong):
    all of them, so that a config's errors are reported at once."""
    found: list[tuple[str, str]] = []
    for name, value in values.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            found.extend(size_problems(value, f"{key}."))
            continue
        kind = size_kind(str(name))
        if kind is None or value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        limit, what = (MAX_LAYERS, "a layer count") if kind == "layers" else (MAX_SIZE, "a size")
        if not isinstance(value, int) or not 1 <= value <= limit:
            found.append(
                (key, f"expected an integer in [1, {limit}] ({what}; the limit is {limit}), found {value!r:.40}")
            )
    return found


def size_problem(values: Mapping[str, Any], prefix: str = "") -> tuple[str, str] | None:
    """The first of ``size_problems``; None when every size is within the bounds."""
    found = size_problems(values, prefix)
    return found[0] if found else None


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, when the OS says."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _configs(config: Any, prefix: str = "model.config") -> list[tuple[str, Any]]:
    """A config and its sub-configs (a VLM's text/vision/audio configs), with their dotted keys."""
    found = [(prefix, config)]
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            found.extend(_configs(sub, f"{prefix}.{name}"))
    return found


def random_init_problem(model_type: str, overrides: dict[str, Any], model_class: type) -> str | None:
    """What keeps ``model_class`` from being built at random from ``overrides`` on this machine (a one-line message
    naming the key), or None. Builds the model on the meta device: no memory, about 1 ms per layer."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.for_model(model_type, **{"use_cache": False, **overrides})
    except (TypeError, ValueError) as exc:
        return f"model.config: {' '.join(str(exc).split())[:300]}"
    for key, sub in _configs(config):
        heads, kv = getattr(sub, "num_attention_heads", None), getattr(sub, "num_key_value_heads", None)
        if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
            return (
                f"{key}.num_key_value_heads: must divide num_attention_heads ({heads} attention heads, {kv} key/value "
                f"heads)"
            )
    try:
        with torch.device("meta"):
            model = model_class(config)
    except (ValueError, TypeError, RuntimeError, ZeroDivisionError, IndexError, KeyError, AttributeError) as exc:
        return f"model.config: {model_type} cannot be built from it: {' '.join(str(exc).split())[:300]}"
    params = sum(p.numel() for p in model.parameters())
    memory = physical_memory()
    if memory is not None and FP32_BYTES * params > memory:
        return (
            f"model.config: it describes a {model_type} of {params:,} parameters ({FP32_BYTES * params / 2**30:,.1f} "
            f"GiB in fp32), more than this machine's {memory / 2**30:,.1f} GiB of memory; a random init builds the "
            f"whole model in fp32 on every rank (the limit: {FP32_BYTES} bytes x parameters <= physical memory)"
        )
    return None
