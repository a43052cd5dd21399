"""The torch range and the one module that holds every version-specific torch path (docs/libraries.md)."""

import ast
import tomllib
from pathlib import Path

import pytest
import torch

from runtime import torch_compat

ROOT = Path(__file__).resolve().parents[1]


def test_the_stated_range_is_the_extra_and_admits_the_installed_torch():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["runtime"]
    (torch_req,) = [r for r in extra if r.startswith("torch")]
    assert torch_req == f"torch{torch_compat.SUPPORTED_TORCH}"
    from packaging.specifiers import SpecifierSet

    assert torch.__version__.split("+")[0] in SpecifierSet(torch_compat.SUPPORTED_TORCH)


def test_the_installed_torch_has_every_api_the_runtime_calls():
    assert torch_compat.missing_apis() == []
    torch_compat.require_supported_torch()


def test_a_torch_without_an_api_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch_compat, "_REQUIRED_APIS", (*torch_compat._REQUIRED_APIS, ("torch", "_no_such_api")))
    with pytest.raises(RuntimeError) as err:
        torch_compat.require_supported_torch()
    message = str(err.value)
    assert "\n" not in message and "torch._no_such_api" in message and torch.__version__ in message


def _private_torch_uses(path: Path) -> list[str]:
    """`import torch.x._y`, `from torch.x._y import ...`, `from torch.x import _y` and `torch.<...>._y` attribute
    chains (aten ops included) in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts) or any(a.name.startswith("_") for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "torch":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{'.'.join(reversed(chain))}")
    return found


def test_every_private_torch_api_is_called_from_torch_compat_only():
    modules = [p for p in sorted((ROOT / "runtime").rglob("*.py")) if p.name != "torch_compat.py"]
    assert [use for path in modules for use in _private_torch_uses(path)] == []
