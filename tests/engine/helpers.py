"""Shared helpers for the engine tests: a fake upstream source and throwaway patchgen projects.

The upstream is `tests/fixtures/upstream/fixturepkg` (plain Python, read as text, never imported); the templates
are `tests/fixtures/templates/fx/*` plus the real `templates/core/` (rename).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst
import pytest

from patchgen.config import ProjectConfig, load_config
from patchgen.errors import PatchgenError
from patchgen.generate import Generated, generate
from patchgen.header import split
from patchgen.spec import Spec, load_spec
from patchgen.upstream import UpstreamFile, module_relpath

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
UPSTREAM_DIR = FIXTURES / "upstream"
FIXTURE_TEMPLATES = FIXTURES / "templates"
PACKAGE = "fixturepkg"
VERSION = "1.2.3"
TOY = "fixturepkg.models.modeling_toy"
PLAIN = "fixturepkg.plain"
# A model module whose block and attention processor live in shared modules (companion specs)
JOINT = "fixturepkg.models.modeling_joint"
BLOCKS = "fixturepkg.models.blocks"
PROCESSORS = "fixturepkg.models.processors"
JOINT_OUTPUT = "generated/joint/modeling_joint.py"

# One patch per operation (rename aside: it changes names the other patches anchor on).
ALL_OPS = [
    dict(
        template="fx/insert_trace",
        scope="ToyLayer.forward",
        after="residual = hidden",
        vars=dict(name="toy", level=3, enabled=False, tags=["a", "b"], ratio=0.25, dims=[1, 2]),
        why="trace the residual",
    ),
    dict(
        template="fx/replace_rescale",
        scope="ToyLayer.forward",
        anchor="hidden = rescale(hidden, factor=self.config.scale)",
        vars=dict(factor=2.0),
        why="scale more",
    ),
    dict(template="fx/wrap_guard", scope="ToyForTask.forward", anchor="self.loss_function", why="guard the loss"),
    dict(template="fx/add_method", scope="ToyModel", vars=dict(name="double_depth"), why="a new method"),
    dict(template="fx/replace_method", scope="ToyModel.default_mask", why="constant mask"),
    dict(
        template="fx/add_definition", scope="<module>", vars=dict(name="bounded", low=-1.0, high=1.0), why="a helper"
    ),
    dict(template="fx/replace_definition", scope="rescale", vars=dict(gain=3), why="gain"),
    dict(
        template="fx/insert_code",
        scope="ToyForTask.forward",
        before="if labels is not None:",
        vars=dict(code="labels_list"),
        why="anchored on a compound header",
    ),
]


def upstream_text(module: str) -> str:
    return (UPSTREAM_DIR / module_relpath(module)).read_text(encoding="utf-8")


def upstream_line(module: str, snippet: str) -> int:
    """1-based line of the only upstream line containing `snippet` (the test's independent line count)."""
    hits = [no for no, line in enumerate(upstream_text(module).splitlines(), start=1) if snippet in line]
    assert len(hits) == 1, f"{snippet!r} occurs on lines {hits} of {module}"
    return hits[0]


class FixtureSource:
    """The UpstreamSource protocol over tests/fixtures/upstream, as package `fixturepkg` at `version`."""

    def __init__(self, version: str = VERSION, overrides: dict[str, str] | None = None) -> None:
        self._version = version
        self.overrides = overrides or {}
        self.reads: list[str] = []

    def version(self, package: str) -> str:
        if package != PACKAGE:
            raise PatchgenError(f"upstream package {package!r} is not installed")
        return self._version

    def read(self, module: str) -> UpstreamFile:
        package = module.split(".")[0]
        relpath = module_relpath(module)
        self.reads.append(module)
        text = self.overrides.get(module)
        if text is None:
            path = UPSTREAM_DIR / relpath
            if not path.is_file():
                raise PatchgenError(f"upstream module {module!r} not found")
            text = path.read_text(encoding="utf-8")
        return UpstreamFile(package, self.version(package), module, relpath, text)


def build_wheel(
    directory: Path, version: str, overrides: dict[str, str] | None = None, name: str | None = None
) -> Path:
    """A minimal, byte-reproducible wheel of the fixture upstream package at `version`: every file of
    tests/fixtures/upstream/fixturepkg (or its override, keyed by module name) plus a dist-info METADATA."""
    overrides = {module_relpath(module): text for module, text in (overrides or {}).items()}
    path = directory / (name or f"{PACKAGE}-{version}-py3-none-any.whl")
    directory.mkdir(parents=True, exist_ok=True)
    dist = f"{PACKAGE}-{version}.dist-info"
    members = {
        p.relative_to(UPSTREAM_DIR).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted((UPSTREAM_DIR / PACKAGE).rglob("*.py"))
    }
    members.update(overrides)
    members[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n"
    members[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: patchgen-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    members[f"{dist}/RECORD"] = ""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, text in members.items():
            archive.writestr(zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return path


@functools.cache
def fixture_wheel_sha256() -> str:
    """sha256 of the genuine fixture wheel at VERSION (`build_wheel` is byte-reproducible)."""
    with tempfile.TemporaryDirectory() as scratch:
        return hashlib.sha256(build_wheel(Path(scratch), VERSION).read_bytes()).hexdigest()


def record_wheel(root: Path, wheel: Path) -> None:
    """Trust `wheel` in the project at `root`: add its sha256 to [tool.patchgen.wheel_sha256] (the last table)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        fields = dict(line.split(": ", 1) for line in archive.read(metadata).decode().splitlines() if ": " in line)
    pyproject = root / "pyproject.toml"
    line = f'"{fields["Name"]}=={fields["Version"]}" = "{hashlib.sha256(wheel.read_bytes()).hexdigest()}"\n'
    pyproject.write_text(pyproject.read_text() + line)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def spec_toml(
    module: str = TOY,
    output: str = "generated/toy/modeling_toy.py",
    keep: list[str] | None = None,
    patches: list[dict[str, Any]] = (),
    **extra: Any,
) -> str:
    """A spec file's text; patches are dicts of patch keys (vars as a dict)."""
    lines = [
        f"module = {toml_value(module)}",
        f"output = {toml_value(output)}",
        f"keep = {toml_value(keep if keep is not None else ['ToyForTask'])}",
    ]
    lines += [f"{key} = {toml_value(value)}" for key, value in extra.items()]
    for patch in patches:
        lines += ["", "[[patch]]"] + [f"{key} = {toml_value(value)}" for key, value in patch.items()]
    return "\n".join(lines) + "\n"


def joint_spec(
    patches: list[dict[str, Any]] = (),
    companions: list[tuple[str, list[str]]] = ((PROCESSORS, ["ToyProcessor"]), (BLOCKS, ["ToyBlock"])),
    **extra: Any,
) -> str:
    """A spec of the joint fixture model with `[[companion]]` tables (by default: the processor and the block)."""
    text = spec_toml(JOINT, JOINT_OUTPUT, ["JointModel"], patches, **extra)
    for module, keep in companions:
        text += f"\n[[companion]]\nmodule = {toml_value(module)}\nkeep = {toml_value(keep)}\n"
    return text


@dataclass
class FixtureProject:
    root: Path

    @property
    def config(self) -> ProjectConfig:
        return load_config(self.root)

    def write_spec(self, text: str, name: str = "toy") -> Path:
        path = self.root / "specs" / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        return path

    def spec(self, name: str = "toy") -> Spec:
        return load_spec(self.config.spec_path(name), self.config.templates_dir)

    def generate(self, name: str = "toy", source: FixtureSource | None = None) -> Generated:
        return generate(self.spec(name), source or FixtureSource(), self.config)

    def snapshot(self) -> dict[str, tuple[bytes, int]]:
        """Bytes and mtime of every file under the project (to prove nothing was written)."""
        return {
            p.relative_to(self.root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }


def make_project(
    root: Path, specs: dict[str, str] | str | None = None, pins: dict[str, str] | None = None
) -> FixtureProject:
    """A throwaway patchgen project: pyproject.toml with [tool.patchgen], specs/, templates/ (fixture + core)."""
    root.mkdir(parents=True, exist_ok=True)
    pins = pins if pins is not None else {PACKAGE: VERSION}
    (root / "pyproject.toml").write_text(
        '[project]\nname = "fixture-project"\nversion = "0"\n\n[tool.patchgen]\nspecs = "specs"\n'
        f'templates = "templates"\ngenerated = "generated"\npins = {toml_value(pins)}\n\n'
        f'[tool.patchgen.wheel_sha256]\n"{PACKAGE}=={VERSION}" = "{fixture_wheel_sha256()}"\n',
        encoding="utf-8",
    )
    (root / "specs").mkdir(exist_ok=True)
    shutil.copytree(FIXTURE_TEMPLATES, root / "templates", dirs_exist_ok=True)
    shutil.copytree(REPO / "templates" / "core", root / "templates" / "core", dirs_exist_ok=True)
    project = FixtureProject(root)
    if isinstance(specs, str):
        specs = {"toy": specs}
    for name, text in (specs or {}).items():
        project.write_spec(text, name)
    return project


def body_of(text: str) -> str:
    fields, body = split(text)
    assert fields is not None, "generated text has no provenance header"
    return body


MARKER = re.compile(r"^# patchgen (?:#\d+ \S+|imports) \((\d+) stmt\): ")


def _marker_count(stmt: cst.BaseStatement) -> int | None:
    counts = [
        int(m.group(1))
        for line in stmt.leading_lines
        if line.comment is not None
        for m in [MARKER.match(line.comment.value)]
        if m
    ]
    return max(counts) if counts else None


class _StripMarked(cst.CSTTransformer):
    """Remove every marked region: the statement carrying a marker and the n-1 statements after it."""

    def _strip(self, body):
        out, skip = [], 0
        for stmt in body:
            if skip:
                skip -= 1
                count = _marker_count(stmt)
                if count:  # a region that starts inside another one (e.g. after-block of a replaced stmt)
                    skip = max(skip, count - 1)
                continue
            count = _marker_count(stmt)
            if count:
                skip = count - 1
                continue
            out.append(stmt)
        return out

    def leave_IndentedBlock(self, original, updated):
        return updated.with_changes(body=self._strip(updated.body))

    def leave_Module(self, original, updated):
        # comments above the first statement parse as the module header: a marker there belongs to the body
        header = list(updated.header)
        starts = [i for i, line in enumerate(header) if line.comment is not None and MARKER.match(line.comment.value)]
        if starts and updated.body:
            first = updated.body[0]
            moved = first.with_changes(leading_lines=[*header[starts[0] :], *first.leading_lines])
            updated = updated.with_changes(header=header[: starts[0]], body=[moved, *updated.body[1:]])
        return updated.with_changes(body=self._strip(updated.body))


def strip_marked(code: str) -> str:
    return cst.parse_module(code).visit(_StripMarked()).code


class _DropStatements(cst.CSTTransformer):
    def __init__(self, ids: set[int]) -> None:
        super().__init__()
        self.ids = ids

    def on_leave(self, original, updated):
        if id(original) in self.ids:
            return cst.RemoveFromParent()
        return updated


def drop_statements(module: cst.Module, statements: list[cst.CSTNode]) -> str:
    return module.visit(_DropStatements({id(s) for s in statements})).code


def run_cli(root: Path, capsys, *args: str) -> tuple[int, str, str]:
    """`patchgen <args> --root <root>` through cli.main in this process: (exit code, stdout, stderr)."""
    from patchgen.cli import main

    argv = sys.argv
    sys.argv = ["patchgen", *args, "--root", str(root)]
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return exit_.value.code, out, err
