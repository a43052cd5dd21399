"""The runtime's layering, read from docs/architecture.md ("### Layers"): no import runs up the table, every folder
and top-level module is placed in it, and no module exceeds 400 lines (split along responsibilities instead)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "runtime"
MAX_LINES = 400
# Modules still over MAX_LINES, each to be split along its responsibilities; the list may only shrink.
OVERSIZE: set[str] = set()


def layer_table() -> dict[str, int]:
    """``folder/`` or ``module.py`` (relative to runtime/) -> its layer, from the docs' table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    table: dict[str, int] = {}
    for row in re.findall(r"^\| (\d+) \|.*\| (.*) \|$", section, flags=re.M):
        for name in re.findall(r"`([^`]+)`", row[1]):
            table[name] = int(row[0])
    return table


def layer_of(path: Path, table: dict[str, int]) -> int:
    rel = path.relative_to(RUNTIME).as_posix()
    if path.name == "__main__.py":
        return max(table.values())
    if rel in table:
        return table[rel]
    top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
    if top not in table:
        raise AssertionError(f"runtime/{rel}: not placed in docs/architecture.md's layer table")
    return table[top]


def module_path(name: str) -> Path | None:
    """The file of ``runtime.x.y`` (a module, or a package's __init__), None if it is no runtime file."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``runtime.*`` import, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("runtime.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("runtime."):
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def test_no_import_runs_up_the_layers() -> None:
    table = layer_table()
    assert table, "docs/architecture.md has no layer table under '### Layers'"
    upward = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path == RUNTIME / "__init__.py":  # the package's face: its docstring, no imports of its own
            assert not runtime_imports(path), "runtime/__init__.py imports: every import belongs to a layer"
            continue
        own = layer_of(path, table)
        for line, name in runtime_imports(path):
            target = module_path(name) or module_path(name.rpartition(".")[0])  # `from pkg import module` or a name
            if target is None or target.parent == RUNTIME and target.name == "__init__.py":
                continue
            theirs = layer_of(target, table)
            if theirs > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} (layer {own}) imports {name} (layer {theirs})")
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_modules_stay_under_400_lines() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for folder in ("runtime", "patchgen")
        for path in (ROOT / folder).rglob("*.py")
    }
    over = sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES and name not in OVERSIZE)
    assert not over, f"modules over {MAX_LINES} lines (split them along their responsibilities):\n" + "\n".join(over)
    shrunk = sorted(name for name in OVERSIZE if sizes.get(name, 0) <= MAX_LINES)
    assert not shrunk, f"now at most {MAX_LINES} lines (or gone): remove from OVERSIZE: {shrunk}"
