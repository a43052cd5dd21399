"""A plan file's ``model`` checked as the trainer checks a run config's (``runtime/train/model_keys.py``,
``runtime/train/model_limits.py``), before any model is built and without importing torch.

transformers and diffusers config classes keep an unknown keyword as a plain attribute, so ``hiden_size: 4096``
would plan the default hidden size and exit 0. A transformers model's keys are its config class's (read from
transformers' source by the trainer's reader); a DiT's are the ``__init__`` parameters of the diffusers class its
generated module patches (read from that module's source here: the trainer takes a DiT's sizes from its checkpoint,
so it has no such reader), plus the two keys the generated config adds. Sizes have the trainer's bounds.
"""

from __future__ import annotations

import ast
from typing import Any

from runtime.train.config_source import ConfigKeys, source_path
from runtime.train.model_keys import model_config_problems, model_type_problem, unknown_config_keys
from runtime.train.model_limits import size_problems

__all__ = ["dit_config_keys", "model_problems"]

# PatchgenDiTConfig's own keys (runtime/diffusion/shell.py), on top of the diffusers class's __init__ parameters
DIT_PROJECT_KEYS = ("condition_model_type", "attention_backend")


def _diffusers_class_name(tree: ast.Module) -> str | None:
    """The class a generated DiT config names as ``diffusers_class = <Name>``."""
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if (
                isinstance(item, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "diffusers_class" for t in item.targets)
                and isinstance(item.value, ast.Name)
            ):
                return item.value.id
    return None


def dit_config_keys(module: str) -> ConfigKeys | None:
    """The keys the generated DiT config of ``module`` accepts, read from its source; None when they cannot be
    enumerated (no such class, or an ``__init__`` taking ``**kwargs``): then the keys are not checked."""
    path = source_path(module)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = _diffusers_class_name(tree)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    init = next(
        (n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is None or init.args.kwarg is not None:
        return None
    params = [a.arg for a in (*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs)][1:]  # less self
    return ConfigKeys(f"{name} (diffusers)", frozenset((*params, *DIT_PROJECT_KEYS)))


def model_problems(model_type: Any, config: dict[str, Any]) -> list[str]:
    """Every problem of a plan's ``model.type`` and ``model.config``, one line each naming the key."""
    problem = model_type_problem(model_type)
    if problem or model_type is None:
        return [problem] if problem else []
    from runtime.models.registry import REGISTRY

    entry = REGISTRY[model_type]
    if entry.family != "dit":
        return model_config_problems(model_type, entry.module, config)
    known = dit_config_keys(entry.module)
    found = unknown_config_keys(known, config) if known is not None else []
    return found + [f"model.config.{key}: {what}" for key, what in size_problems(config)]
