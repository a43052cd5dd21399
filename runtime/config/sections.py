"""Typed config sections: a frozen dataclass built from a YAML mapping, its keys checked against the fields (unknown,
missing, type), its numbers held to 64-bit finite values and its keys to the job's range and choice rules
(``KeyRules``) and its own ``problems`` method where it has one, every error of every section collected at once
(``ConfigErrors``). A section with an ``enabled`` key may be given as a bare bool."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.config.errors import ConfigError, ConfigErrors

__all__ = ["MAX_INT", "KeyRules", "check_choice", "collect_section", "unknown_key_message"]

# Every integer of a run config fits a signed 64-bit value (seeds, counts and ids end up in torch tensors).
MAX_INT = 2**63 - 1


@dataclass(frozen=True)
class KeyRules:
    """Range and choice rules of dotted keys, checked while a section is built (``collect_section``), and the keys a
    job renamed (an old name is refused with the new one). Each job merges the shared sections' rules
    (``runtime/config/common.py``) with its own."""

    positive: frozenset = frozenset()
    non_negative: frozenset = frozenset()
    unit_interval: frozenset = frozenset()  # ratios: [0, 1]
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)  # old dotted key -> what replaced it

    def merged(self, other: KeyRules) -> KeyRules:
        return KeyRules(
            self.positive | other.positive,
            self.non_negative | other.non_negative,
            self.unit_interval | other.unit_interval,
            {**self.choices, **other.choices},
            {**self.renamed, **other.renamed},
        )


def _shown(value: Any) -> str:
    return f"{value!r:.60}"


def _number_problem(value: Any, key: str) -> str | None:
    """Finite floats and 64-bit integers only: a NaN or infinite learning rate trains NaN, a 100-digit seed is an
    overflow deep inside torch."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: must be a finite number, found {value}"
    if isinstance(value, int) and not -MAX_INT - 1 <= value <= MAX_INT:
        return f"{key}: must fit in 64 bits (-2**63 <= value < 2**63), found {_shown(value)}"
    return None


def _check_number(value: Any, key: str) -> None:
    problem = _number_problem(value, key)
    if problem:
        raise ConfigError(problem)


def numbers_within(value: Any, key: str) -> list[str]:
    """``_number_problem`` of every number in a mapping or list value (``model.config``, ``dit.condition``)."""
    stack, seen, found = [(value, key)], set(), []
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict | list):
            if id(item) in seen:  # YAML aliases share objects: walk each once
                continue
            seen.add(id(item))
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((v, f"{where}.{k}" if isinstance(item, dict) else f"{where}[{k}]") for k, v in pairs)
        else:
            problem = _number_problem(item, where)
            if problem:
                found.append(problem)
    return sorted(found)


def check_choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}: unknown value {_shown(value)}; expected one of {', '.join(choices)}{hint}")


def _check_type(value: Any, annotation: Any, key: str) -> Any:
    hint = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None:
        if type(None) in hint:
            return None
        raise ConfigError(f"{key}: must not be null")
    _check_number(value, key)
    for kind in hint:
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if (
            kind in (int, str, bool, list, dict)
            and isinstance(value, kind)
            and not (kind is int and isinstance(value, bool))
        ):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in hint if k is not type(None))
    raise ConfigError(f"{key}: expected {names}, found {type(value).__name__} {value!r}")


def unknown_key_message(prefix: str, name: str, fields: Iterable[str], renamed: Mapping[str, str]) -> str:
    """``<key>: unknown key`` with the nearest known key of the section (a renamed key's new name included)."""
    key = f"{prefix}.{name}" if prefix else name
    if key in renamed:
        return f"{key}: renamed to {renamed[key]}"
    fields = list(fields)
    here = {old.rpartition(".")[2]: new for old, new in renamed.items() if old.rpartition(".")[0] == prefix}
    close = difflib.get_close_matches(str(name), [*fields, *here], n=1, cutoff=0.6)
    hint = ""
    if close and close[0] in here:
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}, now {here[close[0]]}?"
    elif close:
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    return f"{key}: unknown key{hint} (expected one of {', '.join(fields)})"


def _check_rules(value: Any, key: str, rules: KeyRules) -> None:
    if value is not None and key in rules.positive and value <= 0:
        raise ConfigError(f"{key}: must be positive, found {value}")
    if value is not None and key in rules.non_negative and value < 0:
        raise ConfigError(f"{key}: must not be negative, found {value}")
    if value is not None and key in rules.unit_interval and not 0 <= value <= 1:
        raise ConfigError(f"{key}: expected a ratio in [0, 1], found {value}")
    if key in rules.choices:
        check_choice(value, key, rules.choices[key])


def collect_section(cls: type, raw: Any, prefix: str, rules: KeyRules, errors: ConfigErrors) -> Any:
    """The frozen dataclass ``cls`` from the mapping ``raw`` (the section at dotted ``prefix``): unknown and missing
    keys, types, numbers and ``rules`` checked, every error added to ``errors`` (one line each, naming its key). Always
    returns a ``cls``: a refused value is replaced by its default (a required one by None) so that the checks across
    sections still run."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict):
        errors.add(f"{prefix or 'config'}: expected a mapping, found {type(raw).__name__}")
        raw = {}
    hints = typing.get_type_hints(cls)
    errors.add(
        *(unknown_key_message(prefix, name, fields, rules.renamed) for name in sorted(set(raw) - set(fields), key=str))
    )
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in raw:
            if required:
                errors.add(f"{key}: required key missing")
                values[name] = None
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            section = raw[name]
            if isinstance(section, bool) and "enabled" in {f.name for f in dataclasses.fields(hint)}:
                section = {"enabled": section}  # a switchable section's shorthand: `self_check: true`
            values[name] = collect_section(hint, section, key, rules, errors)
            continue
        try:
            value = _check_type(raw[name], hint, key)
            _check_rules(value, key, rules)
        except ConfigError as exc:
            errors.add(*exc.messages)
            if required:
                values[name] = None
            continue
        if isinstance(value, dict | list):
            errors.add(*numbers_within(value, key))  # the value is kept: its keys are checked further on
        values[name] = value
    built = cls(**values)
    if callable(getattr(built, "problems", None)):  # the section's own rules across its keys
        errors.add(*built.problems(prefix))
    return built
