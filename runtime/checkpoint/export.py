"""Export a trained model (plain or FSDP2-sharded) to a directory that plain ``transformers`` loads.

``AutoModelForCausalLM.from_pretrained(out_dir)`` then builds the *upstream* class: generated classes keep the
upstream state-dict keys and config class, so all this takes is the full state dict (gathered to rank 0), the
config with its ``architectures`` pointing at the upstream class and without runtime-only settings, and, if given,
the tokenizer (or processor) together with the special-token ids read from it: bos/eos/pad in ``config.json`` and a
``generation_config.json`` whose stop ids make plain ``generate`` end a reply (``runtime/checkpoint/generation.py``).
The directory appears atomically (written as ``.<name>.tmp`` next to it, then renamed).

An export replaces its directory, so it never touches one it did not write: the exporter leaves a marker
(``EXPORT_MARKER``, listing every file it wrote) in each export, and ``check_export_target`` refuses a non-empty
directory without it, one holding files the marker does not list, and (unless ``overwrite``) an earlier export.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from runtime.checkpoint.dcp import replace_dir_atomically
from runtime.checkpoint.generation import export_generation_config, set_config_token_ids, special_token_ids
from runtime.parallel.state import ParallelState, get_parallel_state

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EXPORT_MARKER = "patchgen_export.json"
_MARKER_FORMAT = "patchgen-export"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Attention implementations the runtime registers in transformers' AttentionInterface under these prefixes exist
# only in a process that imported the runtime; a saved config must name a stock one.
_RUNTIME_ATTN_PREFIXES = ("ulysses_",)


def _tied_targets(model: torch.nn.Module, config: Any) -> set[str]:
    """Keys that ``from_pretrained`` re-ties to another weight (so they must not be saved) when embeddings are tied.

    ``_tied_weights_keys`` is ``{target: source}`` in transformers 5 (a list of targets in older releases).
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return set()
    targets: set[str] = set()
    for module_name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None)
        if not tied:
            continue
        prefix = f"{module_name}." if module_name else ""
        targets.update(prefix + key for key in tied)
    return targets


def prepare_state_dict(
    state_dict: dict[str, torch.Tensor], model: torch.nn.Module, config: Any, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Drop tied copies, cast floating tensors to ``dtype`` and make every tensor own its (contiguous) memory."""
    tied = _tied_targets(model, config)
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state_dict.items():
        if key in tied:
            continue
        tensor = value.detach()
        if hasattr(tensor, "full_tensor"):  # a DTensor that was not gathered: the caller asked for a sharded dict
            raise ValueError(f"{key} is still sharded ({type(value).__name__}); export needs the full state dict")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.to("cpu").contiguous()
        # safetensors refuses tensors that share memory; any sharing left here is not a declared tie, so copy.
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.numel() and ident in seen:
            tensor = tensor.clone()
        seen.add(ident)
        out[key] = tensor
    return to_checkpoint_layout(model, out)


def to_checkpoint_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo transformers' load-time weight conversions (e.g. per-expert MoE weights stacked into 3-D tensors).

    Plain transformers saves checkpoints in the original layout and converts on load; an export must do the same
    so that every loader of the original format (transformers, vLLM, ...) reads it.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _split(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def save_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[str]:
    """One ``model.safetensors``, or numbered shards plus ``model.safetensors.index.json`` above the size limit."""
    shards = _split(tensors, max_shard_bytes)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], out_dir / SAFE_WEIGHTS_NAME, metadata=metadata)
        return [SAFE_WEIGHTS_NAME]
    names, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / name, metadata=metadata)
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
    return names


def export_config(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PretrainedConfig:
    """A copy of ``config`` that plain transformers maps to its upstream class (causal LM, or image-text-to-text)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model_type {model_type!r} is unknown to plain transformers; cannot export it for AutoModelForCausalLM"
        )
    config = copy.deepcopy(config)
    # the class upstream's save_pretrained names: a text model's causal LM, a VLM's image-text-to-text model
    upstream = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(
        model_type
    )
    if upstream is not None:
        config.architectures = [upstream]
    attn = getattr(config, "_attn_implementation", None)
    if isinstance(attn, str) and attn.startswith(_RUNTIME_ATTN_PREFIXES):
        config._attn_implementation = attn.split("_", 1)[1]
    if dtype is not None:  # the dtype of the weights as written, so that dtype="auto" loads them as they are
        config.dtype = dtype
    restore_use_cache(config)
    return config


def restore_use_cache(config: PretrainedConfig) -> None:
    """``use_cache`` back to its config class's default in ``config`` and its text config: the trainer turns the KV
    cache off (``runtime/train/model.py``), an exported checkpoint must generate with one, as upstream's does."""
    for target in {id(c): c for c in (config, config.get_text_config())}.values():
        default = type(target)().to_dict()
        if "use_cache" in default:
            target.use_cache = default["use_cache"]
        elif "use_cache" in target.__dict__:  # set by the trainer on a config class that has no such key
            del target.use_cache


def _scrub_config_json(path: Path) -> None:
    """Drop any runtime-only attention implementation that made it into the json (it would not resolve)."""
    data = json.loads(path.read_text())
    dirty = [
        k
        for k, v in data.items()
        if "attn_implementation" in k and isinstance(v, str) and v.startswith(_RUNTIME_ATTN_PREFIXES)
    ]
    for key in dirty:
        del data[key]
    if dirty:
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", EXPORT_MARKER}


def _copy_processor_files(source: Path, out_dir: Path) -> None:
    """A VLM processor directory is copied file by file (tokenizer, image/video processor configs, chat template):
    some processors cannot save themselves (one built without its optional video processor), and the user's files
    are what the checkpoint should ship. Model files of a checkpoint directory are left out."""
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in _MODEL_FILES and path.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy2(path, out_dir / path.name)


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    if isinstance(tokenizer, str | Path) and (Path(tokenizer) / "processor_config.json").is_file():
        _copy_processor_files(Path(tokenizer), out_dir)
        return
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer must be a path or have save_pretrained, got {type(tokenizer).__name__}")
    tokenizer.save_pretrained(out_dir)


class ExportTargetError(ValueError):
    """The export directory is not one an export may replace; the message is one line naming it."""


def _marker_files(directory: Path) -> set[str] | None:
    """The files an export listed in its marker, or None when ``directory`` holds no (readable) marker."""
    try:
        data = json.loads((directory / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == _MARKER_FORMAT else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def _write_marker(directory: Path, unproven: str | None = None) -> None:
    """The marker listing the export's files; ``unproven``: the run skipped its layout proof (``train.self_check``
    off), recorded as ``layout`` so that whoever loads the export can see it."""
    files = sorted({p.name for p in directory.iterdir()} | {EXPORT_MARKER})
    record = {"format": _MARKER_FORMAT, "version": 1, "files": files}
    if unproven is not None:
        record["layout"] = unproven
    text = json.dumps(record, indent=2) + "\n"
    (directory / EXPORT_MARKER).write_text(text, encoding="utf-8")


def _is_within(path: Path, other: Path) -> bool:
    """``path`` is ``other`` or lies below it."""
    return path == other or other in path.parents


def _check_replaceable(directory: Path, what: str, overwrite: bool) -> None:
    """``directory`` (existing) may be removed: empty, or an export whose marker lists every file in it."""
    if not directory.is_dir():
        raise ExportTargetError(f"{what} {directory} exists and is not a directory")
    entries = sorted(p.name for p in directory.iterdir())
    if not entries:
        return
    listed = _marker_files(directory)
    if listed is None:
        raise ExportTargetError(
            f"{what} {directory} is a non-empty directory that is not an earlier export (no {EXPORT_MARKER}); an "
            f"export replaces its whole directory: choose a new or empty one"
        )
    foreign = [name for name in entries if name not in listed]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ExportTargetError(
            f"{what} {directory} holds files the export did not write ({shown}); move them or choose another directory"
        )
    if not overwrite:
        raise ExportTargetError(
            f"{what} {directory} holds an earlier export; set export.overwrite: true to replace it, or choose "
            f"another directory"
        )


def check_export_target(
    out_dir: str | Path, *, overwrite: bool = False, protected: dict[str, str | Path] | None = None
) -> Path:
    """Refuse an export target that would delete something else; return it resolved. Cheap: call it before training.

    Refused: the file system root; a path equal to or containing any ``protected`` one (name -> path, e.g. the
    checkpoint or log directory: named in the message); an existing non-directory; a non-empty directory that is not
    an earlier export or holds files the export did not write; an earlier export unless ``overwrite``; a place where
    the export's temporary sibling cannot be created. Raises ``ExportTargetError`` (one line, starting
    ``export.dir:``).
    """
    what = "export.dir:"
    out = Path(os.path.abspath(out_dir))  # resolves ".", keeps symlinks as the user wrote them
    if out.parent == out:
        raise ExportTargetError(f"{what} {out} is the file system root")
    real = out.resolve()
    for name, path in (protected or {}).items():
        if path is not None and _is_within(Path(path).resolve(), real):
            raise ExportTargetError(
                f"{what} {out} is or contains {name} {path}; an export replaces its whole directory: choose a "
                f"separate one"
            )
    if out.exists() or out.is_symlink():
        _check_replaceable(out, what, overwrite)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        _check_replaceable(tmp, f"{what} the leftover", overwrite=True)
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(f"{ancestor} is not a directory")
        fd, probe = tempfile.mkstemp(prefix=".patchgen-write-probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ExportTargetError(f"{what} cannot write {out}: {ancestor}: {reason}") from None
    return out


def export_hf(
    model: torch.nn.Module,
    config: Any,
    out_dir: Path,
    state: ParallelState | None = None,
    *,
    tokenizer: Any | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    merge: Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], torch.nn.Module]] | None = None,
    unproven: str | None = None,
) -> Path:
    """Write ``out_dir`` for ``AutoModelForCausalLM.from_pretrained``. Collective: every rank calls it.

    The full state dict is gathered to rank 0 (on CPU), which alone writes. ``dtype`` casts the floating weights,
    which otherwise keep the training dtype; either way the saved config's ``dtype`` records it. ``tokenizer`` is a
    path (a tokenizer directory, or a VLM processor directory: copied) or an object with ``save_pretrained``; its
    bos/eos/pad and chat end-of-turn ids go into ``config.json`` and ``generation_config.json`` (written always).
    ``out_dir`` must pass ``check_export_target`` (``overwrite`` replaces an earlier export; nothing else is ever
    replaced): checked again here on every rank, so a directory that changed during training is still refused.
    ``merge`` (a LoRA run, ``runtime/checkpoint/lora_export.py``): on rank 0, the gathered state dict -> the merged
    plain weights and the plain module whose names and layout they have. ``unproven``: what the marker records of a
    run that skipped its layout proof. Returns ``out_dir`` once it is in place on every rank.
    """
    state = state if state is not None else get_parallel_state()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else state.rank
    out_dir = check_export_target(out_dir, overwrite=overwrite)
    # Collective for FSDP2; with cpu_offload only rank 0 ends up holding the tensors.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        layout = model
        if merge is not None:  # a LoRA run: the adapters merged, under the plain model's names and layout
            full, layout = merge(full)
        tensors = prepare_state_dict(full, layout, config, dtype)
        del full
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        if tmp.exists():  # left by an export that died (check_export_target made sure it is one)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write_marker(tmp, unproven)  # first, so that a leftover of this export is recognisably one
        save_safetensors(tensors, tmp, max_shard_bytes)
        floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
        hf_config = export_config(config, dtype if dtype is not None or len(floating) != 1 else floating.pop())
        token_ids = special_token_ids(tokenizer) if tokenizer is not None else None
        if token_ids is not None:  # so that plain generate stops at the trained end-of-turn / eos tokens
            set_config_token_ids(hf_config, token_ids)
        hf_config.save_pretrained(tmp)
        _scrub_config_json(tmp / "config.json")
        export_generation_config(model, hf_config, token_ids).save_pretrained(tmp)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, tmp)
        _write_marker(tmp, unproven)  # now listing every file written
        replace_dir_atomically(tmp, out_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out_dir
