"""The lists of models in README.md and docs/*.md, written from the specs so that a new spec cannot leave them behind.

A list is a marked region, `<!-- models:SELECTOR:begin -->...<!-- models:SELECTOR:end -->`, inline in a sentence:
`python -m tools.doc_lists` rewrites every region's text from the specs' `[model]` tables (the tables the registry's
records are written from) and `--check` (also tests/engine/test_doc_lists.py, in `make test`) fails naming each stale
region. It lives outside patchgen/ because every engine module is hashed into each generated header.

SELECTOR is one family or several joined by `+` (`causal_lm`, `vlm`, `omni`, `dit`, `vlm+omni`), each optionally
narrowed by `:FILTER`: a capability (`:moe`, `:video`, ...) or `:flow`, the DiTs whose condition model predicts the
flow velocity (what `runtime.rl` trains; read from the condition model's source, not imported: no torch). A region
holds each model's `model_type` in backticks, sorted, joined by ", ".
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from patchgen.config import ProjectConfig, load_config
from patchgen.errors import PatchgenError
from patchgen.files import write_text_atomic
from patchgen.model import CAPABILITIES, FAMILIES
from patchgen.spec_set import load_specs

DOC_GLOBS = ("README.md", "docs/*.md")
MARKER = re.compile(r"<!-- models:(?P<selector>\S*?):(?P<end>begin|end) -->")
FLOW = "flow"
# where a DiT's condition model lives (runtime/diffusion/conditions/__init__.py: one module per condition_model_type)
CONDITIONS = Path("runtime/diffusion/conditions")
REWRITE = "python -m tools.doc_lists"


@dataclass(frozen=True)
class Listed:
    model_type: str
    family: str
    capabilities: tuple[str, ...]
    condition_model_type: str | None


@dataclass(frozen=True)
class Region:
    doc: str  # relative to the project root
    line: int
    selector: str
    start: int  # the body's span in the doc's text
    stop: int


def listed_models(config: ProjectConfig) -> list[Listed]:
    """Every spec that declares a model (a processor spec declares none), sorted by model type."""
    found = [
        Listed(m.model_type, m.family, m.capabilities, m.data.get("condition_model_type"))
        for m in (spec.model for spec in load_specs(config, None))
        if m is not None
    ]
    return sorted(found, key=lambda m: m.model_type)


def regions(doc: str, text: str) -> list[Region]:
    """The marked regions of one doc, each begin closed by the end of the same selector before the next begin."""
    found, opened = [], None
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        selector, is_end = match["selector"], match["end"] == "end"
        if opened is None and is_end:
            raise PatchgenError(f"{doc}:{line}: <!-- models:{selector}:end --> closes no region; remove it")
        if opened is not None and (not is_end or selector != opened[0]):
            raise PatchgenError(
                f"{doc}:{opened[1]}: <!-- models:{opened[0]}:begin --> is not closed before line {line}; "
                f"add <!-- models:{opened[0]}:end --> after its list"
            )
        if not is_end:
            opened = (selector, line, match.end())
            continue
        found.append(Region(doc, opened[1], selector, opened[2], match.start()))
        opened = None
    if opened is not None:
        raise PatchgenError(
            f"{doc}:{opened[1]}: <!-- models:{opened[0]}:begin --> is never closed; "
            f"add <!-- models:{opened[0]}:end --> after its list"
        )
    return found


def render(config: ProjectConfig, region: Region, models: list[Listed]) -> str:
    """The region's text: the selected model types, in backticks, sorted, joined by ", "."""
    families, filters = selector_parts(region)
    chosen = [
        f"`{m.model_type}`"
        for m in models
        if m.family in families
        and all(_flow(config, m) if name == FLOW else name in m.capabilities for name in filters)
    ]
    if not chosen:
        raise PatchgenError(f"{region.doc}:{region.line}: models:{region.selector} selects no spec's model")
    return ", ".join(chosen)


def selector_parts(region: Region) -> tuple[list[str], list[str]]:
    """The families and the filters a region's selector names, each checked (no spec needs to be read for that)."""
    families, *filters = region.selector.split(":")
    names = families.split("+")
    for name in names:
        if name not in FAMILIES:
            raise PatchgenError(
                f"{region.doc}:{region.line}: models:{region.selector}: unknown family {name!r}; expected one of "
                f"{', '.join(FAMILIES)}, joined by '+'"
            )
    for name in filters:
        if name != FLOW and name not in CAPABILITIES:
            raise PatchgenError(
                f"{region.doc}:{region.line}: models:{region.selector}: unknown filter {name!r}; expected "
                f"{FLOW!r} or a capability ({', '.join(CAPABILITIES)})"
            )
    return names, filters


def _flow(config: ProjectConfig, model: Listed) -> bool:
    """Whether a DiT's condition model predicts the flow velocity: its class's `prediction`, else the base class's."""
    if model.condition_model_type is None:
        return False
    folder = config.root / CONDITIONS
    own = _class_attribute(folder / f"{model.condition_model_type}.py", "prediction")
    return (own or _class_attribute(folder / "base.py", "prediction")) == FLOW


def _class_attribute(path: Path, name: str) -> str | None:
    """The string a class body of `path` assigns to `name` (plain or annotated), None when none does."""
    if not path.is_file():
        raise PatchgenError(f"{path}: missing; the `:flow` filter reads each DiT's condition model from it")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
            value = getattr(statement, "value", None)
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(value, ast.Constant):
                return str(value.value)
    return None


def docs_of(config: ProjectConfig) -> list[Path]:
    return sorted({path for pattern in DOC_GLOBS for path in config.root.glob(pattern) if path.is_file()})


def stale_lists(config: ProjectConfig, write: bool = False) -> tuple[list[str], int]:
    """One line per region whose list differs from the specs' (rewritten when `write`), and how many regions there
    are. Every region is parsed and rendered before any doc is written: a bad region anywhere writes nothing."""
    docs = []
    for path in docs_of(config):
        doc, text = path.relative_to(config.root).as_posix(), path.read_text(encoding="utf-8")
        found = regions(doc, text)
        for region in found:
            selector_parts(region)  # a malformed selector fails before the specs are read
        docs.append((path, doc, text, found))
    models = listed_models(config) if any(found for *_, found in docs) else []
    stale, total, texts = [], 0, {}
    for path, doc, text, found in docs:
        pieces, last = [], 0
        for region in found:
            total += 1
            want, have = render(config, region, models), text[region.start : region.stop]
            if want != have:
                stale.append(
                    f"{doc}:{region.line}: the models:{region.selector} list differs from specs/ "
                    f"(has {have.strip() or 'nothing'}; the specs give {want})"
                )
            pieces += [text[last : region.start], want]
            last = region.stop
        new = "".join(pieces) + text[last:]
        if new != text:
            texts[path] = new
    if write:
        for path, new in texts.items():
            write_text_atomic(path, new)
    return stale, total


def main(argv: list[str] | None = None) -> int:
    """Rewrite the stale lists (or, with --check, name them and exit 1); a bad region is one line and exit 2."""
    parser = argparse.ArgumentParser(
        prog=f"{REWRITE}", description="Rewrite the lists of models in README.md and docs/*.md from the specs."
    )
    parser.add_argument("--check", action="store_true", help="only name the stale lists (exit 1); write nothing")
    parser.add_argument("--root", type=Path, help="project root (default: found from the cwd)")
    args = parser.parse_args(argv)
    try:
        stale, total = stale_lists(load_config(args.root), write=not args.check)
    except PatchgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in stale:
        print(("STALE " if args.check else "rewrote ") + line, file=sys.stderr if args.check else sys.stdout)
    if args.check and stale:
        print(f"run `{REWRITE}` to rewrite them", file=sys.stderr)
        return 1
    print(f"ok: {total} model list(s) in README.md and docs/*.md match specs/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
