"""Run config files: YAML read with PyYAML's safe loader (YAML 1.2 floats), held to a size (``MAX_CONFIG_BYTES``) and
shape (``runtime/config/shape.py``), overrides set, parsed by the job's ``parse``; every error located at the file
and line of its key (or the command-line override that set it), in the order of the lines."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from runtime.config.errors import ConfigError, message_key
from runtime.config.overrides import Override, apply_overrides, command_line_position, override_of
from runtime.config.shape import MAX_CONFIG_DEPTH, shape_problem

__all__ = [
    "MAX_CONFIG_BYTES",
    "ConfigLoader",
    "key_line",
    "load_config",
    "locate_error",
    "locate_errors",
    "read_config_file",
]

# A run config is a page of YAML: anything larger is not one (and would only cost time to parse).
MAX_CONFIG_BYTES = 1 << 20
ParsedConfig = TypeVar("ParsedConfig")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading ``1e-4`` as a float, as YAML 1.2 does (YAML 1.1 wants ``1.0e-4`` and PyYAML
    reads ``lr: 1e-4`` as a string)."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def key_line(path: Path, dotted: str) -> int | None:
    """The 1-based line of the deepest key of ``dotted`` (``a.b.c``) that the YAML file ``path`` spells out."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        match = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        if match is None:
            break
        line = next(k for k, v in node.value if v is match).start_mark.line + 1
        node = match
    return line


def locate_error(message: str, path: Path) -> str:
    """``message`` (starting with the dotted key it concerns) prefixed with the config file and the key's line."""
    key = message_key(message)
    line = key_line(path, key) if key else None
    return f"{path}:{line}: {message}" if line else f"{path}: {message}"


def _read_text(path: Path) -> str:
    """The config file's text: a UTF-8 file of at most ``MAX_CONFIG_BYTES``, else a one-line ``ConfigError``."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: not a file (expected a YAML run config)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: more than {MAX_CONFIG_BYTES} bytes (1 MiB), the limit for a run config; is it the right file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None


def read_config_file(path: str | Path) -> Any:
    """The YAML data of a run config file, refused in one line (``ConfigError`` naming the file) when it is not a
    readable UTF-8 file of at most ``MAX_CONFIG_BYTES``, not YAML, or too deep or too large once expanded."""
    path = Path(path)
    text = _read_text(path)
    try:
        raw = yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:  # deeper than Python's recursion limit, which is above MAX_CONFIG_DEPTH
        raise ConfigError(
            f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep, the limit for a run config"
        ) from None
    except ValueError as exc:  # a value YAML parses but Python cannot hold (e.g. an integer of 5000 digits)
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    problem = shape_problem(raw)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return raw


def locate_errors(
    exc: ConfigError,
    path: Path,
    overrides: Sequence[Override] = (),
    locate: Callable[[str, Path], str] = locate_error,
) -> ConfigError:
    """Every message of ``exc`` with where its key was set: the command-line override that set it (``override
    --train.steps: ...``), else the config file and the key's line (``locate``)."""
    out: list[str] = []
    for message in exc.messages:
        key = message_key(message)
        item = override_of(key, overrides) if key and not message.startswith("override --") else None
        if item is None:
            out.append(message if message.startswith("override --") else locate(message, path))
        elif message.startswith(f"{item.key}:"):
            out.append(f"override --{item.key}:{message[len(item.key) + 1 :]}")
        else:
            out.append(f"override --{item.key}: {message}")
    prefix = f"{path}:"

    def line(message: str) -> tuple[float, int]:  # the file's errors by line, then the overrides' as typed
        number = message[len(prefix) :].partition(":")[0] if message.startswith(prefix) else ""
        return int(number) if number.isdigit() else math.inf, command_line_position(message, overrides)

    return ConfigError(*sorted(out, key=line))


def load_config(
    path: str | Path,
    overrides: Sequence[Override],
    parse: Callable[[Any], ParsedConfig],
    locate: Callable[[str, Path], str] = locate_error,
) -> ParsedConfig:
    """The config in the YAML file ``path`` with the command-line ``overrides`` set, read by the job's ``parse``
    (the trainer's ``parse_config``, the RL job's ``parse_rl_config``); every error of it in one ``ConfigError``, each
    message naming the file and line (``locate``) or the override, and the key."""
    path = Path(path)
    raw, problems = apply_overrides(read_config_file(path), overrides)
    if problems:
        raise ConfigError(*problems)
    try:
        return parse(raw)
    except ConfigError as exc:
        raise locate_errors(exc, path, overrides, locate) from None
