"""The ``rewards`` list of an RL config checked without torch, so that its mistakes are reported with every other
config error, at once, before anything is built: each entry names one kind (``KINDS``) and only that kind's keys, a
numeric weight, a non-empty target and name, and a model reward's directories exist. Building the rewards
(``runtime/rl/rewards/``: importing a callable, loading a CLIP checkpoint) finds what only building can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["KINDS", "OPTIONS", "default_name", "reward_entry_problems"]

KINDS = (
    "callable",
    "http",
    "clip",
    "pickscore",
    "aesthetic",
    "vlm_judge",
    "ocr",
    "jpeg_compressibility",
    "jpeg_incompressibility",
)
COMMON = ("weight", "name")
OPTIONS = {
    "callable": ("kwargs",),
    "http": ("timeout",),
    "clip": ("processor", "batch_size"),
    "pickscore": ("processor", "batch_size"),
    "aesthetic": ("head", "batch_size"),
    "vlm_judge": ("question", "batch_size"),
    "ocr": ("question", "batch_size", "max_new_tokens"),
    "jpeg_compressibility": ("scale",),
    "jpeg_incompressibility": ("scale",),
}
MODEL_KINDS = ("clip", "pickscore", "aesthetic", "vlm_judge", "ocr")  # a local checkpoint directory
FLAG_KINDS = ("jpeg_compressibility", "jpeg_incompressibility")  # `kind: true`: nothing to load


def default_name(index: int, kind: str) -> str:
    return f"{kind}{index}"


def reward_entry_problems(index: int, spec: dict[str, Any]) -> list[str]:
    """Every problem of entry ``index`` (a mapping) of the rewards list, one line each naming ``rewards[i].key``."""
    key = f"rewards[{index}]"
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        return [f"{key}: name exactly one reward kind ({', '.join(KINDS)}), found {kinds or 'none'}"]
    kind = kinds[0]
    allowed = (kind, *COMMON, *OPTIONS[kind])
    problems = [
        f"{key}.{name}: unknown key for a {kind} reward; expected one of {', '.join(allowed)}"
        for name in sorted(set(spec) - set(allowed), key=str)
    ]
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        problems.append(f"{key}.weight: expected a number, found {weight!r}")
    target = spec[kind]
    if kind in FLAG_KINDS:
        if target is not True:
            problems.append(f"{key}.{kind}: expected true (the reward takes no checkpoint), found {target!r}")
        scale = spec.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            problems.append(f"{key}.scale: expected a positive number, found {scale!r}")
    elif not isinstance(target, str) or not target:
        problems.append(f"{key}.{kind}: expected a string, found {target!r}")
    name = spec.get("name", default_name(index, kind))
    if not isinstance(name, str) or not name:
        problems.append(f"{key}.name: expected a non-empty string, found {name!r}")
    if kind in MODEL_KINDS:
        batch_size = spec.get("batch_size", 32)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            problems.append(f"{key}.batch_size: expected a positive whole number, found {batch_size!r}")
        for option, value in ((kind, target), ("processor", spec.get("processor"))):
            if isinstance(value, str) and value and not Path(value).is_dir():
                problems.append(f"{key}.{option}: {value}: not a directory (a local checkpoint saved by transformers)")
        problems += _model_option_problems(key, kind, spec)
    return problems


def _model_option_problems(key: str, kind: str, spec: dict[str, Any]) -> list[str]:
    """The options only some model rewards take: the aesthetic head's file, a question, a generation length."""
    problems = []
    if kind == "aesthetic":
        head = spec.get("head")
        if not isinstance(head, str) or not head:
            problems.append(
                f"{key}.head: required: the predictor head's weights (.safetensors or .pth), found {head!r}"
            )
        elif not Path(head).is_file():
            problems.append(f"{key}.head: {head}: not a file")
    question = spec.get("question", "?")
    if not isinstance(question, str) or not question:
        problems.append(f"{key}.question: expected a non-empty string, found {question!r}")
    tokens = spec.get("max_new_tokens", 32)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        problems.append(f"{key}.max_new_tokens: expected a positive whole number, found {tokens!r}")
    return problems
