"""The drafted spec as TOML text: every patch preceded by a comment saying what was recognised and where, the
`[model]` table with its tiny config and variants, and `[model.unsupported]` for what draft did not recognise."""

from __future__ import annotations

import json
import re
from typing import Any

from patchgen.draft.recognised import Found, Recognised

_BARE = re.compile(r"[A-Za-z0-9_-]+")
CAPABILITY_ORDER = ("moe", "sliding_window")


def value(item: Any) -> str:
    """One TOML value: strings as JSON writes them (valid TOML basic strings), tables inline."""
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int | float):
        return repr(item)
    if isinstance(item, str):
        return json.dumps(item)
    if isinstance(item, list | tuple):
        return "[" + ", ".join(value(v) for v in item) + "]"
    if isinstance(item, dict):
        return "{ " + ", ".join(f"{key(k)} = {value(v)}" for k, v in item.items()) + " }"
    raise TypeError(f"no TOML form for {type(item).__name__}")


def key(name: str) -> str:
    return name if _BARE.fullmatch(name) else json.dumps(name)


def _table(name: str, items: dict[str, Any]) -> list[str]:
    return [f"[{name}]", *(f"{key(k)} = {value(v)}" for k, v in items.items())]


def spec_text(
    found: Recognised,
    pin: str,
    tiny: dict[str, Any],
    variants: dict[str, dict[str, Any]],
    capabilities: list[str],
    notes: list[str],
) -> str:
    """The whole spec file: deterministic for one upstream release (`patchgen draft --check` diffs it)."""
    target = found.target
    lines = [
        f"# {target.causal_lm}: drafted by `patchgen draft {target.model_type}` from {pin} {found.upstream.relpath}.",
        "# Each patch's comment says what draft recognised upstream and where; edit by hand only what it could not.",
        f'module = "{target.module}"',
        f'output = "generated/{target.name}/{target.module.rsplit(".", 1)[1]}.py"',
        f"keep = {value([target.causal_lm])}",
        "",
    ]
    model: dict[str, Any] = {
        "model_type": target.model_type,
        "class": target.causal_lm,
        "upstream": "transformers.AutoModelForCausalLM",
        "family": "causal_lm",
    }
    ordered = sorted(capabilities, key=CAPABILITY_ORDER.index)
    if ordered:
        model["capabilities"] = ordered
    if found.handles:
        model["handles"] = found.handles
    lines += [*_table("model", model), ""]
    lines += [f"# tiny random config by draft's rule (docs/adding-a-model.md): {'; '.join(notes) or 'dense'}"]
    lines += [*_table("model.tiny", tiny), ""]
    if found.data:
        lines += [*_table("model.data", found.data), ""]
    for name, overrides in variants.items():
        lines += [f"# a config-gated branch the tiny config does not take: {name}"]
        lines += [*_table(f"model.data.tiny_variants.{name}", overrides), ""]
    if found.unsupported:
        lines += ["# not recognised (draft never guesses): the runtime refuses these layouts quoting the reason"]
        lines += [*_table("model.unsupported", found.unsupported), ""]
    for patch in found.patches:
        lines += [*_patch(patch), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _patch(patch: Found) -> list[str]:
    out = [f"# recognised: {patch.note}", "[[patch]]", f'template = "{patch.template}"', f'scope = "{patch.scope}"']
    if patch.anchor is not None:
        out.append(f"{patch.place} = {value(patch.anchor)}")
    if patch.through is not None:
        out.append(f"through = {value(patch.through)}")
    if patch.vars:
        out.append(f"vars = {value(patch.vars)}")
    out.append(f"why = {value(patch.why)}")
    return out
