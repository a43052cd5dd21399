"""Which model a checkpoint belongs to: its type and the config that built it, recorded in the completion marker and
compared before a resume reads a single weight.

DCP loads by key and ignores keys the model does not ask for, so the weights of another model can load without an
error: a qwen3 checkpoint resumed as llama fills llama's weights (a subset of qwen3's) and drops q_norm/k_norm;
a checkpoint of the same shapes with another config (rope_theta, rms_norm_eps) loads and means something else.
An identity is JSON data ``{"type": model_type, "config": canonical config}``, plus ``"lora"`` (the adapter's rank,
alpha and targets) for a LoRA run, whose checkpoint holds only an adapter that means nothing under other settings; two
are the same model when they are equal, and their differences are named as dotted keys (``model.type``,
``model.config.rope_parameters.rope_theta``, ``lora.rank``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Config entries that do not change what the weights mean: provenance, storage dtype and switches of a forward's
# outputs. Left out at every level (a VLM's sub-configs carry them too), so moving model.path, upgrading
# transformers or asking for attentions never refuses a resume.
VOLATILE_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
    }
)

_SHOWN = 6  # differing keys named in one message


def canonical(value: Any) -> Any:
    """``value`` as the JSON data it is stored as: configs as their ``to_dict()``, volatile keys dropped, keys sorted;
    anything that is not JSON data (a dtype, an enum) as its ``str``."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return {str(k): canonical(v) for k, v in items if k not in VOLATILE_KEYS}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def model_identity(
    model_type: str, config: PretrainedConfig | Mapping[str, Any], lora: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The identity a checkpoint records: ``model_type`` and ``config`` (a transformers config or a mapping), and a
    LoRA run's adapter settings ``lora`` (a mapping)."""
    identity = {"type": str(model_type), "config": canonical(config)}
    if lora is not None:
        identity["lora"] = canonical(lora)
    return identity


def unproven_identity(identity: dict[str, Any], train: Any) -> dict[str, Any]:
    """``identity`` with ``layout: "layout unproven (...)"`` when the job's ``train.self_check`` is off: the record a
    checkpoint keeps of a run that trained without its layout proof. Not compared on resume (the model is the same)."""
    unproven = train.self_check.unproven
    return identity if unproven is None else {**identity, "layout": unproven}


def module_identity(module: Any) -> dict[str, Any]:
    """The identity of a module saved without one: its config's ``model_type`` and config, if it has a config,
    else its class name and no config."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None) or type(module).__name__
    return model_identity(model_type, {} if config is None else config)


def is_identity(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("type"), str) and isinstance(value.get("config"), dict)


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN equals NaN here


def _differences(saved: Any, current: Any, prefix: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out: list[str] = []
        for key in sorted(set(saved) | set(current)):
            if key not in saved or key not in current:
                out.append(f"{prefix}.{key}")
            else:
                out.extend(_differences(saved[key], current[key], f"{prefix}.{key}"))
        return out
    return [] if _same(saved, current) else [prefix]


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The dotted keys where two identities differ (``model.type`` first), empty when they are the same model."""
    out = [] if saved["type"] == current["type"] else ["model.type"]
    out += _differences(saved["config"], current["config"], "model.config")
    return out + _differences(saved.get("lora"), current.get("lora"), "lora")


def _value_at(identity: dict[str, Any], dotted: str) -> Any:
    node: Any = {"model": identity, "lora": identity.get("lora")}
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "(absent)"
        node = node[part]
    return node


def mismatch_message(checkpoint: Any, saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """One line saying how the run's model differs from the checkpoint's, or None when it does not."""
    keys = identity_differences(saved, current)
    if not keys:
        return None
    first = keys[0]
    detail = f"{first}: saved {_value_at(saved, first)!r}, this run {_value_at(current, first)!r}"
    more = f"; also {', '.join(keys[1:_SHOWN])}" if len(keys) > 1 else ""
    more += f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    settings = "the lora settings" if first.startswith("lora") else "the model.type and model config"
    return (
        f"checkpoint {checkpoint} was saved by another model than this run builds ({detail}{more}); resume it with "
        f"{settings} it was saved with, or set checkpoint.resume: null to start over"
    )
