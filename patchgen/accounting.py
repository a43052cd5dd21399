"""What a replacing patch may remove: the statements its template re-implements and the ones its spec drops.

A patch whose op replaces upstream code (`replace`, with or without `through`; `replace_method`;
`replace_definition`) deletes statements. Each one must be accounted for, or regen fails
(`patchgen.cst.removals`): the template's front matter lists the statements its rendered code re-implements
(`reimplements`), the spec's patch lists the deliberate removals (`removes`). Both are *statement starts*: text
compared with the start of a statement's normalized one-line form (`ast.unparse`; a compound statement by its
header, e.g. `if labels is not None:`). Without this, a loss template replacing a region that held an upstream
logit softcap trained the unsoftcapped model with exit 0. No libcst here: loading a spec stays libcst-free.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

WILDCARD = "*"  # a generic test template whose rendered code is the spec's own choice: it accounts for anything
MAX_STARTS = 256
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")  # `{{ target }} =`: the patch's value of an identifier var
PLACEHOLDER_KINDS = ("identifier", "dotted", "word", "expr")  # values that are one line of normalized code


@dataclass(frozen=True)
class Reimplemented:
    """One `reimplements` entry: the start of an upstream statement the rendered code re-implements; with
    `when_set`, only when the patch sets that variable to something other than its default (a config-gated
    upstream block the template re-implements only when told how, e.g. a logit softcap)."""

    start: str
    when_set: str | None = None


def normalize_start(text: str) -> str:
    """An entry as `ast.unparse` would write the statement it starts: a full statement or compound header is
    normalized (quotes, spacing), a partial one (`logits = self.lm_head(`) is kept as written, stripped."""
    text = " ".join(text.split()) if "\n" not in text.strip() else text.strip()
    candidate = text + ("\n    pass" if text.endswith(":") else "")
    if candidate.startswith("try:"):
        candidate += "\nexcept:\n    pass"
    try:
        return ast.unparse(ast.parse(candidate)).split("\n")[0]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return text


def matches(start: str, statement: str) -> bool:
    """Whether a normalized statement (or header) starts with an entry."""
    return start == WILDCARD or statement.startswith(start)


def substitute(start: str, values: dict[str, Any]) -> str:
    """An entry with each `{{ var }}` placeholder replaced by the patch's value of that variable (a name, or an
    expression in its normalized one-line form)."""
    return PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), start)


def parse_reimplements(
    value: Any, declared: dict[str, Any], names: tuple[str, ...], where: str
) -> tuple[Reimplemented, ...] | str:
    """A template's `reimplements` list (strings, or tables `{ start = "...", when_set = "<var>" }`), or what is
    wrong with it; `declared` maps each variable name to whether it has a default, `names` are the variables
    whose value is one line of code (identifier, dotted, word, expr), which a start may use as `{{ var }}`."""
    if not isinstance(value, list) or len(value) > MAX_STARTS:
        return f"{where}: 'reimplements' must be a list of at most {MAX_STARTS} statement starts"
    out = []
    for number, item in enumerate(value):
        text, when = (item.get("start"), item.get("when_set")) if isinstance(item, dict) else (item, None)
        if (
            isinstance(item, dict)
            and not set(item) <= {"start", "when_set"}
            or not (isinstance(text, str) and text.strip())
        ):
            return (
                f"{where}: reimplements[{number}] must be a statement start (a non-empty string) or a table "
                f'{{ start = "...", when_set = "<var>" }}; found {item!r}'
            )
        if when is not None and not (isinstance(when, str) and declared.get(when) is True):
            return (
                f"{where}: reimplements[{number}].when_set = {when!r} must name a declared variable with a default "
                f"(the entry counts when a spec sets it to something else)"
            )
        unknown = [m.group(1) for m in PLACEHOLDER.finditer(text) if m.group(1) not in names]
        if unknown:
            return (
                f"{where}: reimplements[{number}]: {{{{ {unknown[0]} }}}} must name a declared identifier, dotted, "
                f"word or expr variable (its value is substituted)"
            )
        out.append(Reimplemented(_start(text), when))
    return tuple(out)


def _start(text: str) -> str:
    return WILDCARD if text.strip() == WILDCARD else normalize_start(text)


def parse_removes(value: Any) -> tuple[str, ...] | None:
    """A patch's `removes` list, normalized; None when it is not a list of non-empty strings."""
    if not isinstance(value, list) or len(value) > MAX_STARTS:
        return None
    if not all(isinstance(v, str) and v.strip() and v.strip() != WILDCARD for v in value):
        return None
    return tuple(normalize_start(v) for v in value)
