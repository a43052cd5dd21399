"""Export a trained DiT (plain or FSDP2-sharded, full or LoRA) in the formats plain diffusers loads.

* **Full weights**: a complete diffusers pipeline directory, ``<Pipeline>.from_pretrained(out_dir)``: every component
  of the pipeline the run started from (``model.path``: ``model_index.json``, VAE, text encoders, tokenizers,
  scheduler) copied, and ``transformer/`` written by the shell's diffusers save (``config.json`` with only the
  diffusers ``__init__`` parameters, safetensors with upstream key names).
* **LoRA**: ``pytorch_lora_weights.safetensors`` written by the pipeline class's own ``save_lora_weights``
  (``transformer.``-prefixed peft keys plus the adapter config as metadata), which
  ``pipeline.load_lora_weights(out_dir)`` accepts (a pipeline class without that loader: peft's adapter directory);
  ``fuse`` writes full weights with the adapter merged instead.

The directory rules of ``runtime/checkpoint/export.py`` apply unchanged (``check_export_target``: never replaces a
directory it did not write; an earlier export only with ``overwrite``; written as ``.<name>.tmp`` and renamed into
place; the ``patchgen_export.json`` marker lists what was written).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from runtime.checkpoint.dcp import replace_dir_atomically
from runtime.checkpoint.export import _write_marker, check_export_target

__all__ = ["LORA_WEIGHT_NAME", "export_dit", "full_state_dict", "pipeline_class"]

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what load_lora_weights(dir) looks for
_TRANSFORMER = "transformer"


def pipeline_class(pipeline_dir: str | Path) -> type:
    """The diffusers pipeline class a pipeline directory names in its ``model_index.json``."""
    import diffusers

    name = json.loads((Path(pipeline_dir) / "model_index.json").read_text())["_class_name"]
    return getattr(diffusers, name)


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, CPU; other ranks get an empty dict. Collective under FSDP."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _copy_pipeline(source: Path, out_dir: Path, component: str = _TRANSFORMER) -> None:
    """Every pipeline component but the trained transformer ``component``, as files (a later change of the source
    leaves it alone): a pipeline's other expert (Wan2.2 A14B's ``transformer_2``) is copied as it is."""
    for entry in sorted(source.iterdir()):
        if entry.name.startswith(".") or entry.name == component:
            continue
        if entry.is_dir():
            shutil.copytree(entry, out_dir / entry.name)
        else:
            shutil.copy2(entry, out_dir / entry.name)


def _save_peft_adapter(out_dir: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """A pipeline class without diffusers' LoRA loader (``PixArtSigmaPipeline``: its transformer has no
    ``load_lora_adapter`` either) gets the adapter as peft saves it, ``adapter_model.safetensors`` and
    ``adapter_config.json``, which peft's ``PeftModel.from_pretrained(pipe.transformer, out_dir)`` loads."""
    from safetensors.torch import save_file

    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()}, out_dir / "adapter_model.safetensors"
    )
    (out_dir / "adapter_config.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")


def export_dit(
    out_dir: str | Path,
    *,
    pipeline_dir: str | Path,
    write_weights: Callable[[Path], None] | None = None,
    lora: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
    overwrite: bool = False,
    rank: int = 0,
    component: str = _TRANSFORMER,
    unproven: str | None = None,
) -> Path:
    """Write ``out_dir`` on rank 0 (every rank calls it; it ends with a barrier).

    Full weights: ``write_weights(transformer_dir)`` writes the transformer's diffusers model directory, and the rest
    of ``pipeline_dir`` is copied beside it. LoRA: ``lora = (tensors keyed like blocks.0.attn1.to_q.lora_A.weight,
    peft config metadata)``, written by the pipeline class's ``save_lora_weights``. ``component``: the pipeline's
    transformer folder that was trained (``transformer_2``: the low-noise expert of Wan2.2 A14B; its LoRA file loads
    with ``load_lora_weights(dir, load_into_transformer_2=True)``). ``unproven``: what the export's marker records of
    a run that skipped its layout proof.
    """
    if (write_weights is None) == (lora is None):
        raise ValueError("export_dit: pass exactly one of write_weights or lora")
    out_dir = check_export_target(out_dir, overwrite=overwrite)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # every rank has checked before rank 0 starts writing the temporary directory
        dist.barrier()
    if rank == 0:
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        if tmp.exists():  # left by an export that died (check_export_target made sure it is one)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write_marker(tmp, unproven)  # first, so that a leftover of this export is recognisably one
        if lora is not None:
            tensors, metadata = lora
            cls = pipeline_class(pipeline_dir)
            if not hasattr(cls, "save_lora_weights"):
                _save_peft_adapter(tmp, tensors, metadata)
            else:
                cls.save_lora_weights(
                    tmp,
                    transformer_lora_layers={k: v.contiguous() for k, v in tensors.items()},
                    weight_name=LORA_WEIGHT_NAME,
                    transformer_lora_adapter_metadata=metadata,
                )
        else:
            _copy_pipeline(Path(pipeline_dir), tmp, component)
            write_weights(tmp / component)
        _write_marker(tmp, unproven)  # now listing every file written
        replace_dir_atomically(tmp, out_dir)
    if distributed:
        dist.barrier()
    return out_dir
