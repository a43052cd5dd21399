"""Dotted command-line overrides of a run config: ``--train.steps=3``, ``--optim.lr 1e-4``,
``--log.report_to=[tensorboard]``.

Each value is read as YAML (a scalar or a flow collection), with the config file's own loader, and set into the
loaded mapping before validation, so an override is checked exactly like the same value in the file. Errors about an
overridden key name the override (``override --train.steps: ...``) instead of a line of the file.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from runtime.config.shape import MAX_CONFIG_DEPTH, shape_problem

_KEY = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


class OverrideError(ValueError):
    """A command-line override that is not ``--dotted.key=value`` / ``--dotted.key value`` (a usage error)."""


@dataclass(frozen=True)
class Override:
    key: str  # dotted: train.steps
    value: Any  # the value read as YAML
    text: str  # the value as typed


def parse_value(text: str, key: str, loader: type = yaml.SafeLoader) -> Any:
    """The value of override ``--key`` read as YAML, held to the config file's caps on nesting and on values once
    aliases are expanded (``runtime.config.yaml_file.read_config_file``), counted where the value lands in the config:
    a value 60000 lists deep is a one-line error, not a RecursionError."""
    try:
        value = yaml.load(text, Loader=loader)  # a SafeLoader (subclass): no arbitrary objects
    except yaml.YAMLError as exc:
        raise OverrideError(
            f"override --{key}: not a YAML value: {getattr(exc, 'problem', exc)} in {text!r:.200}"
        ) from None
    except RecursionError:  # deeper than Python's recursion limit, which is above MAX_CONFIG_DEPTH
        raise OverrideError(
            f"override --{key}: nested more than {MAX_CONFIG_DEPTH} levels deep, the limit for a run config"
        ) from None
    placed = value
    for part in reversed(key.split(".")):  # as deep as the same value written in the file
        placed = {part: placed}
    problem = shape_problem(placed)
    if problem:
        raise OverrideError(f"override --{key}: {problem}")
    return value


def parse_overrides(args: Sequence[str], loader: type = yaml.SafeLoader) -> list[Override]:
    """``--a.b=v`` and ``--a.b v`` arguments as overrides, in order (a later one of the same key wins)."""
    out: list[Override] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--") or arg == "--":
            raise OverrideError(f"{arg!r}: expected an override --section.key=value after the config file")
        key, eq, text = arg[2:].partition("=")
        if not _KEY.match(key):
            raise OverrideError(f"{arg!r}: an override names a dotted key, e.g. --train.steps=3")
        if not eq:
            if not rest or rest[0].startswith("--"):
                raise OverrideError(f"override --{key}: expected a value (--{key}=VALUE or --{key} VALUE)")
            text = rest.pop(0)
        out.append(Override(key, parse_value(text, key, loader), text))
    return out


def apply_overrides(raw: Any, overrides: Sequence[Override]) -> tuple[Any, list[str]]:
    """A copy of the loaded config ``raw`` with ``overrides`` set (sections created as needed), and the overrides
    that could not be set (a key below a value that is not a mapping), each a message naming the override."""
    if not overrides:
        return raw, []
    out = copy.deepcopy(raw) if raw is not None else {}
    errors: list[str] = []
    if not isinstance(out, dict):
        return out, [f"config: expected a mapping of sections, found {type(out).__name__}"]
    for item in overrides:
        node, parts = out, item.key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                errors.append(f"override --{item.key}: {where} is a {type(child).__name__}, not a section")
                break
            node = child
        else:
            node[parts[-1]] = item.value
    return out, errors


def command_line_position(message: str, overrides: Sequence[Override]) -> int:
    """Where on the command line the override a located message names (``override --KEY: ...``) was typed (the
    last of that key: the one that won), so that errors are reported in the order they were typed; after every
    override for any other message."""
    key = message[len("override --") :].partition(":")[0] if message.startswith("override --") else None
    found = [index for index, item in enumerate(overrides) if item.key == key]
    return found[-1] if found else len(overrides)


def override_of(key: str, overrides: Sequence[Override]) -> Override | None:
    """The (last) override that set ``key`` or a section or value holding it."""
    for item in reversed(overrides):
        if key == item.key or key.startswith((item.key + ".", item.key + "[")):
            return item
    return None
