"""Whether a model's safetensors files are whole, read from their headers only: ``safe_open`` parses a file's header
and checks that its tensors cover the file exactly, so a truncated download or copy is found in milliseconds, before
any rank loads the model (where safetensors' ``SafetensorError`` would stop the run with a traceback). No diffusers
import: the launcher runs this check."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

__all__ = ["damaged_transformer_weights", "damaged_weight_files", "safetensors_problem"]


def safetensors_problem(path: Path) -> str | None:
    """Why safetensors would refuse to load ``path`` (one line), or None when its header describes the whole file."""
    try:
        with safe_open(str(path), framework="pt"):
            return None
    except (SafetensorError, OSError) as exc:
        return " ".join(str(exc).split())[:200]


def damaged_weight_files(directory: Path) -> list[tuple[Path, str]]:
    """``(file, why)`` of every ``*.safetensors`` file directly in ``directory`` that safetensors would refuse."""
    checked = ((path, safetensors_problem(path)) for path in sorted(directory.glob("*.safetensors")))
    return [(path, why) for path, why in checked if why is not None]


def damaged_transformer_weights(pipeline: Path) -> str | None:
    """The first damaged weight file of a diffusers pipeline's transformer(s) (``transformer/``, and a second
    expert's ``transformer_2/``) and what to do, in one line; None when every one is whole."""
    for folder in sorted(pipeline.glob("transformer*/")):
        for path, why in damaged_weight_files(folder):
            return f"{path}: not a whole safetensors file ({why}); copy or download it again"
    return None
