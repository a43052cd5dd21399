"""The export of a LoRA run of a transformers model, both ways, through peft itself.

Both load the trained tensors (gathered to rank 0, assigned without a copy) into the *upstream* transformers class,
built on the meta device (no memory) and wrapped by ``peft.get_peft_model`` with the run's peft config; the trained
model's keys are the upstream ones (generated classes keep them), under peft's ``base_model.model.`` prefix.

* adapter (``export.fuse_lora: false``): ``PeftModel.save_pretrained`` writes ``adapter_config.json`` and
  ``adapter_model.safetensors`` (peft's keys and config: ``PeftModel.from_pretrained(plain_model, dir)`` loads them,
  MoE experts' adapted parameters included); only the adapter is gathered. The tokenizer or processor is saved
  beside it, and ``base_model_name_or_path`` names ``model.path`` when the run started from one.
* merged (``true``): peft's ``merge_and_unload`` folds every adapter (Linear layers and adapted parameters) into its
  base weight, and ``export_hf`` writes the plain model as it writes a full fine-tune.

Either directory is written like ``export_hf``'s: atomically, with the export marker, never over anything else.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from runtime.checkpoint.dcp import replace_dir_atomically
from runtime.checkpoint.export import (
    _save_tokenizer,
    _write_marker,
    check_export_target,
    export_config,
    export_hf,
)
from runtime.checkpoint.lora_weights import ADAPTER, adapter_modules
from runtime.parallel.state import ParallelState, get_parallel_state

__all__ = ["export_lora", "plain_peft_model"]

_PREFIX = "base_model.model."


def plain_peft_model(
    base_class: type, config: Any, peft_config: Any, tensors: dict[str, torch.Tensor], base_path: str | None = None
) -> tuple[Any, list[str]]:
    """The upstream model of ``config`` (``base_class``: a transformers class or Auto class) wrapped by peft with
    ``peft_config``, holding ``tensors`` (trained-model keys); (the peft model, keys it holds no tensor for).
    Keys the plain model does not have are an error: they would be left out of the export silently."""
    from peft import get_peft_model

    hf_config = export_config(config)
    build = base_class.from_config if hasattr(base_class, "from_config") else base_class._from_config
    with torch.device("meta"):
        base = build(hf_config)
    peft_config = copy.deepcopy(peft_config)
    peft_config.base_model_name_or_path = base_path
    model = get_peft_model(base, peft_config, adapter_name=ADAPTER)
    loaded = model.load_state_dict({_PREFIX + k: v for k, v in tensors.items()}, strict=False, assign=True)
    if loaded.unexpected_keys:
        keys = [k.removeprefix(_PREFIX) for k in loaded.unexpected_keys]
        raise ValueError(f"the plain {type(base).__name__} has no {', '.join(keys[:3])} (of {len(keys)} weights)")
    return model, [k.removeprefix(_PREFIX) for k in loaded.missing_keys]


def _merged(
    full: dict[str, torch.Tensor], base_class: type, config: Any, peft_config: Any
) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    model, missing = plain_peft_model(base_class, config, peft_config, full)
    if missing:
        raise ValueError(f"the trained model's state dict lacks {', '.join(missing[:3])} (of {len(missing)})")
    plain = model.merge_and_unload()
    return plain.state_dict(), plain


def export_lora(
    model: torch.nn.Module,
    config: Any,
    out_dir: Path,
    peft_config: Any,
    base_class: type,
    state: ParallelState | None = None,
    *,
    fuse: bool = False,
    tokenizer: Any | None = None,
    base_path: str | None = None,
    overwrite: bool = False,
    unproven: str | None = None,
) -> Path:
    """Write the adapter of the LoRA-trained ``model`` (or, ``fuse``, the merged plain model) to ``out_dir``.
    Collective: every rank calls it; rank 0 writes. Returns ``out_dir`` once it is in place on every rank."""
    if fuse:
        merge = lambda full: _merged(full, base_class, config, peft_config)  # noqa: E731
        return export_hf(
            model, config, out_dir, state, tokenizer=tokenizer, overwrite=overwrite, merge=merge, unproven=unproven
        )
    state = state if state is not None else get_parallel_state()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else state.rank
    out_dir = check_export_target(out_dir, overwrite=overwrite)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = get_model_state_dict(adapter_modules(model), options=options)  # collective under FSDP2
    if rank == 0:
        adapter = {key.replace("/", "."): value for key, value in gathered.items()}
        peft_model, missing = plain_peft_model(base_class, config, peft_config, adapter, base_path)
        if any(".lora_" in key for key in missing):
            raise ValueError(f"the trained model has no {', '.join(k for k in missing if '.lora_' in k)[:200]}")
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        if tmp.exists():  # left by an export that died (check_export_target made sure it is one)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write_marker(tmp, unproven)  # first, so that a leftover of this export is recognisably one
        peft_model.save_pretrained(tmp)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, tmp)
        _write_marker(tmp, unproven)  # now listing every file written
        replace_dir_atomically(tmp, out_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out_dir
