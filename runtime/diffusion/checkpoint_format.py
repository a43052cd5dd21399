"""Read and write transformer checkpoints in the exact diffusers layout, without diffusers' model loading code.

A diffusers model directory holds ``config.json`` (the ``__init__`` arguments plus ``_class_name`` and
``_diffusers_version``) and ``diffusion_pytorch_model.safetensors``, or, when large, numbered shards listed by
``diffusion_pytorch_model.safetensors.index.json`` (``weight_map``: key -> file). Key names are the module's
``state_dict`` names, so ``<Class>.from_pretrained`` of plain diffusers reads what ``write_model_dir`` writes. A
``variant`` (e.g. ``fp16``) names the weight files as diffusers does (``diffusion_pytorch_model.fp16.safetensors``,
``diffusion_pytorch_model.safetensors.index.fp16.json``), through diffusers' own ``_add_variant``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers.utils import _add_variant
from diffusers.utils.constants import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ["read_config", "read_weights", "write_model_dir"]

# diffusers' default; a shard is written when the model is larger.
DEFAULT_MAX_SHARD_SIZE = "10GB"


def read_config(directory: str | os.PathLike, class_name: str) -> dict[str, Any]:
    """``config.json`` of a diffusers model directory: its keys minus the ``_``-prefixed metadata.

    Refuses a directory whose ``_class_name`` names another class (a Flux checkpoint is not a Wan one).
    """
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no diffusers config.json; pass a model directory (or a pipeline directory with subfolder=)"
        )
    config = json.loads(path.read_text())
    found = config.get("_class_name")
    if found is not None and found != class_name:
        raise ValueError(f"{path}: _class_name is {found!r}, expected {class_name!r}")
    return {k: v for k, v in config.items() if not k.startswith("_")}


def read_weights(directory: str | os.PathLike, variant: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a diffusers model directory: one safetensors file, or the shards its index lists."""
    directory = Path(directory)
    single = directory / _add_variant(SAFETENSORS_WEIGHTS_NAME, variant)
    index = directory / _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    if single.is_file():
        return _load_file(single)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(_load_file(directory / shard))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ValueError(f"{index}: keys listed in weight_map but absent from the shards: {missing[:5]}")
        return state
    raise FileNotFoundError(f"{directory}: neither {single.name} nor {index.name}")


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    """``load_file``, with a file safetensors refuses (truncated, damaged) a ``ValueError`` naming it: the loaders'
    callers report a ``ValueError`` in one line; safetensors' own error is none of the built-in ones."""
    try:
        return load_file(path)
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a whole safetensors file: {' '.join(str(exc).split())[:200]}") from None


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def write_model_dir(
    directory: str | os.PathLike,
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    variant: str | None = None,
) -> list[str]:
    """Write ``config.json`` (``config`` as given: the caller adds ``_class_name`` / ``_diffusers_version``) and the
    weights, sharded above ``max_shard_size``. Returns the weight file names written.

    Stale weight files of an earlier save of the same variant in the same directory are removed so the directory is
    unambiguous (other variants stay: diffusers keeps fp32 and fp16 weights side by side).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(
        json.dumps({k: _json_value(v) for k, v in config.items()}, indent=2, sort_keys=True) + "\n"
    )
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    stem = _add_variant(SAFETENSORS_WEIGHTS_NAME, variant).removesuffix(".safetensors")
    index_name = _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern=stem + "{suffix}.safetensors", max_shard_size=max_shard_size
    )
    stale = re.compile(re.escape(stem) + r"(-\d{5}-of-\d{5})?\.safetensors")
    for old in directory.iterdir():
        if stale.fullmatch(old.name) or old.name == index_name:
            old.unlink()
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, directory / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (directory / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return sorted(split.filename_to_tensors)
