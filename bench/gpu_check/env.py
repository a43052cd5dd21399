"""The versions a check ran with: a figure is only comparable with another from the same stack."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

PACKAGES = ("torch", "triton", "transformers", "diffusers", "accelerate", "peft", "safetensors", "libcst", "typer")


def versions() -> dict[str, Any]:
    """Package versions (None: not installed), CUDA/cuDNN, the device's name and memory, and where each came from
    (a wheel carried in ``.whl/`` is installed under /tmp/site, ahead of the image's own on PYTHONPATH)."""
    import torch

    found: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    for name in PACKAGES:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
            continue
        found[name] = dist.version
        found[f"{name}_from"] = str(dist.locate_file(""))
    found["cuda"] = torch.version.cuda
    found["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["device"] = props.name
        found["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        found["capability"] = f"{props.major}.{props.minor}"
    else:
        found["device"] = "cpu (no CUDA device)"
    return found


def pins() -> dict[str, str]:
    """What the generated files were made from (pyproject.toml's ``[tool.patchgen] pins``): a mismatch is a note,
    the image's transformers 5.17 being newer than the pinned 5.14.1 unless the carried wheel is installed."""
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    return dict(data["tool"]["patchgen"]["pins"])
