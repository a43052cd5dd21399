"""Hostile findings, round 4 (engine): each test failed on the code before its fix.

1. `upgrade --verify` installed unmet requirements from the writable wheel cache without a hash check;
2. an `expr` spec value could hold a call that the generated module runs (and `--migrate --verify` imports it);
3. staging a spec (or a report) beside its file followed a symlink planted at the staging name;
4. a template rendering invalid Python printed libcst's multi-line parser dump;
5. a spec whose output package is named like a diffusers pipelines package made saved pipelines unloadable.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.files import write_text_atomic
from patchgen.spec_set import load_specs
from patchgen.templates import load_template
from patchgen.upstream import read_wheel
from patchgen.wheels import wheel_cache
from tests.engine.helpers import (
    PLAIN,
    REPO,
    TOY,
    VERSION,
    FixtureSource,
    build_wheel,
    make_project,
    run_cli,
    spec_toml,
)
from tests.engine.test_migrate import HEAD, MOVED, NEW_V, OLD, OLD_V, edits, left, run
from tests.engine.test_migrate import setup as migration_project

FROM = ("--from", f"fixturepkg=={VERSION}")


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(root: Path, capsys, *args: str) -> str:
    """Run the CLI: exit 2, one line on stderr, nothing on stdout, no file changed."""
    before = tree(root)
    code, out, err = run_cli(root, capsys, *args)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
    assert "Traceback" not in err and tree(root) == before
    return err


# ---- 1. the scratch venv of --verify installs only wheels whose sha256 the project records ------------------------


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), files: dict | None = None) -> Path:
    """A small pure-Python wheel that pip installs (its RECORD lists every file with its hash)."""
    stem = name.replace("-", "_")
    dist = f"{stem}-{version}.dist-info"
    members = dict(files or {f"{stem}/__init__.py": f"VERSION = {version!r}\n"})
    members[f"{dist}/METADATA"] = "".join(
        [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
    )
    members[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for member, text in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(text.encode())}\n")
    members[f"{dist}/RECORD"] = "".join(record) + f"{dist}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in members.items():
            archive.writestr(member, text)
    return path


def _sha(path: Path) -> frozenset[str]:
    return frozenset({hashlib.sha256(path.read_bytes()).hexdigest()})


def test_verify_never_installs_an_unrecorded_wheel_planted_in_the_wheel_cache(tmp_path, monkeypatch) -> None:
    """The release needs three packages the project venv lacks: one recorded with its hash (installed), one whose
    cached wheel is not the recorded file, one recorded nowhere (planted: a .pth runs at every interpreter start)."""
    from patchgen.verify import make_env

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nothing from a registry in this test
    cache, marker = tmp_path / "cache", tmp_path / "planted-code-ran"
    needs = ("round4-good>=1", "round4-tampered==1.0", "round4-planted")
    target = read_wheel(_wheel(tmp_path / "given", "round4-release", "2.0", needs))
    good = _wheel(cache, "round4_good", "1.5")
    genuine = _wheel(tmp_path / "elsewhere", "round4_tampered", "1.0")
    tampered = _wheel(cache, "round4_tampered", "1.0", files={"round4_tampered/__init__.py": "EVIL = 1\n"})
    pth = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
    _wheel(cache, "round4_planted", "1.0", files={"round4_planted.pth": pth, "round4_planted/__init__.py": ""})
    trusted = {
        "round4_release==2.0": _sha(target.path),
        "round4_good==1.5": _sha(good),
        "round4_tampered==1.0": _sha(genuine),
    }
    assert _sha(tampered) != _sha(genuine)
    python, installed, unmet = make_env(tmp_path / "venv", [target], cache, trusted)
    subprocess.run([python, "-c", "pass"], check=True, timeout=120)  # an interpreter start: .pth files run
    assert not marker.exists()
    assert sorted(i.replace("-", "_") for i in installed) == ["round4_good==1.5", "round4_release==2.0"], installed
    text = "\n".join(unmet)
    assert "round4-planted (of round4_release; not installed" in text and "round4-tampered==1.0" in text, text
    assert "[tool.patchgen.wheel_sha256]" in text


# ---- 2. an expr value is data: a small grammar without calls ------------------------------------------------------

PARAMETER = dict(template="core/add_parameter", scope="Counter.add", why="a new parameter")


def test_an_expr_var_holding_a_call_is_refused_at_regen_in_one_line(tmp_path, capsys) -> None:
    """`core/add_parameter` renders its default into a signature: evaluated when the generated module is imported."""
    planted = tmp_path / "pwned"
    call = f"__import__('pathlib').Path({str(planted)!r}).write_text('x')"
    patch = {**PARAMETER, "vars": dict(name="scale", default=call)}
    proj = make_project(tmp_path / "proj", spec_toml(PLAIN, "generated/plain/m.py", ["Counter"], [patch]))
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert "specs/toy.toml: patch 1 (core/add_parameter): vars.default must be exactly one Python expression" in err
    assert "no calls" in err and "__import__" in err, err
    assert not planted.exists() and not (proj.root / "generated").exists()


@pytest.mark.parametrize(
    "value",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd').read()",
        "getattr(self, 'x')",
        "self.config.get_text_config(__import__('os'))",  # a whitelisted method, an argument that is code
        "kwargs.get(key=1)",
        "kwargs.get(*args)",
        "requests.get('http://x')",  # .get on anything but kwargs
        "self.config.get_text_config(1)",
        "self.helper()",  # a method that is not whitelisted
        "(lambda: 1)",
        "[x for x in y]",
        "(y := 1)",
        "f'{x}'",
        "x.__class__",
        "__builtins__",
        "{1: 2}",
        "*x",
        "(yield)",
    ],
)
def test_an_expr_var_outside_the_grammar_is_refused_when_the_spec_loads(tmp_path, value) -> None:
    patch = {**PARAMETER, "vars": dict(name="scale", default=value)}
    proj = make_project(tmp_path / "proj", spec_toml(PLAIN, "generated/plain/m.py", ["Counter"], [patch]))
    with pytest.raises(PatchgenError, match=r"patch 1 \(core/add_parameter\): vars.default must be exactly one") as e:
        proj.spec()
    assert "\n" not in str(e.value)


def _expr_values() -> set[str]:
    """Every expr value the project's specs give and every default its templates declare."""
    templates = REPO / "templates"
    kinds: dict[str, set[str]] = {}
    values: set[str] = set()
    for path in sorted(templates.rglob("*.py.j2")):
        template = load_template(templates, path.relative_to(templates).as_posix()[: -len(".py.j2")])
        kinds[template.name] = {v.name for v in template.vars if v.kind.scalar == "expr"}
        values |= {v.default for v in template.vars if v.kind.scalar == "expr" and not v.required}
    for spec in sorted((REPO / "specs").glob("*.toml")):
        for patch in tomllib.loads(spec.read_text()).get("patch", []):
            for name, value in patch.get("vars", {}).items():
                if name in kinds.get(patch["template"], ()):
                    values |= set(value) if isinstance(value, list) else {value}
    return values


def test_every_expr_value_the_project_uses_is_in_the_grammar(tmp_path) -> None:
    values = _expr_values()
    assert "self.config.get_text_config().vocab_size" in values and 'kwargs.get("token_mask")' in values
    for value in sorted(values):  # each one as a spec value (the templates' defaults load with them)
        patch = {**PARAMETER, "vars": dict(name="scale", default=value)}
        text = spec_toml(PLAIN, "generated/plain/m.py", ["Counter"], [patch])
        make_project(tmp_path / f"p{len(os.listdir(tmp_path))}", text).spec()


def _migrated_texts(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A real migration's spec texts (rule 1: the anchor and the var that follows the changed argument)."""
    migration = run(tmp_path, MOVED, [dict(template="mig/head_var", **HEAD)])
    root = tmp_path / "proj"
    return root, {p.relative_to(root).as_posix(): t for p, t in migration.texts.items()}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda t: (
                t + '\n[[patch]]\ntemplate = "fx/insert_code"\nscope = "Net.forward"\n'
                'before = "out = head(hidden)"\nvars = { code = "probe" }\nwhy = "added"\n'
            ),
            "patch 2",
        ),
        (lambda t: t.replace('keep = ["Net"]', 'keep = ["Net", "head"]'), "key 'keep'"),
        (lambda t: t.replace('template = "mig/head_var"', 'template = "mig/head_fixed"'), "patch 1: key 'template'"),
    ],
)
def test_verify_refuses_spec_edits_beyond_what_migration_changes(tmp_path, change, named) -> None:
    """`--migrate --verify` imports code regenerated from specs nobody reviewed yet: that is safe because migration
    changes only anchors, scopes and var values (data of checked kinds); a text changing more is refused up front."""
    from patchgen.verify import verify

    root, texts = _migrated_texts(tmp_path)
    ((relpath, text),) = texts.items()
    cache = wheel_cache(root)
    wheel = read_wheel(next(cache.glob(f"*{NEW_V}*.whl")))
    bad = {relpath: change(text)}
    with pytest.raises(PatchgenError, match=rf"{relpath}: .*{named}.*anchor, before, after, through, scope, vars"):
        verify(root, [wheel], FixtureSource(OLD_V, {TOY: OLD}), cache, spec_edits=bad)


def test_verify_accepts_what_migration_changes(tmp_path) -> None:
    from patchgen.verify_edits import check_spec_edits

    root, texts = _migrated_texts(tmp_path)
    assert texts and "vars = { hidden = " in next(iter(texts.values()))
    check_spec_edits(load_config(root), texts)


def test_migration_never_writes_a_call_into_an_expr_var(tmp_path) -> None:
    """Rule 1 sets an expr var to the release's new argument: when that argument is a call, the edit is left."""
    new = OLD.replace("out = head(hidden[:keep])", "out = head(trim(hidden))")
    migration = run(tmp_path, new, [dict(template="mig/head_var", **HEAD)])
    assert edits(migration) == {}
    assert "vars.hidden must be exactly one Python expression" in left(migration)[1]
    assert "it calls trim(...)" in left(migration)[1]


# ---- 3. staging files are created exclusively, never through a planted symlink -----------------------------------


def test_apply_specs_does_not_write_through_a_symlink_planted_at_the_staging_name(tmp_path, capsys) -> None:
    proj, _ = migration_project(tmp_path / "proj", MOVED, [dict(template="mig/head_var", **HEAD)])
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    spec = proj.root / "specs" / "toy.toml"
    (proj.root / "specs" / ".toy.toml.patchgen-tmp").symlink_to(outside)
    args = ("upgrade", "--to", f"fixturepkg=={NEW_V}", "--migrate", "--apply-specs")
    code, out, err = run_cli(proj.root, capsys, *args)
    assert code == 1, err  # the pinned specs still do not apply; the migrated ones were written
    assert outside.read_text() == "precious\n"
    assert not spec.is_symlink() and spec.is_file() and 'anchor = "out = head(hidden)"' in spec.read_text()
    assert "wrote  specs/toy.toml" in out


def test_write_text_atomic_does_not_write_through_a_symlink_planted_at_the_staging_name(tmp_path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    report = tmp_path / "project" / "REPORT.md"
    report.parent.mkdir()
    (report.parent / ".REPORT.md.patchgen-tmp").symlink_to(outside)
    write_text_atomic(report, "the report\n")
    assert outside.read_text() == "precious\n"
    assert not report.is_symlink() and report.read_text() == "the report\n"
    assert os.path.islink(report.parent / ".REPORT.md.patchgen-tmp")  # left alone, not followed


# ---- 4. a template rendering invalid Python: one line, not libcst's parser dump ------------------------------------


def test_a_template_rendering_invalid_python_is_one_line(tmp_path, capsys) -> None:
    bad = dict(
        template="fx/bad_syntax",
        scope="ToyModel.forward",
        before="return [h / norm for h in hidden]",
        vars=dict(cond="ready"),
        why="x",
    )
    proj = make_project(tmp_path / "proj", spec_toml(patches=[bad]))
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    template = proj.root / "templates" / "fx" / "bad_syntax.py.j2"
    assert f"specs/toy.toml: patch 1 (fx/bad_syntax) in scope 'ToyModel.forward': template {template}" in err
    assert "renders invalid Python: line 1, column 9: expected ':' in 'if ready'" in err, err
    assert "parser error" not in err and "expected one of" not in err


def test_a_template_import_that_is_not_one_import_statement_is_one_line(tmp_path, capsys) -> None:
    proj = make_project(tmp_path / "proj")
    (proj.root / "templates" / "fx" / "bad_import.py.j2").write_text(
        '{#\nop = "insert"\ndoc = "d"\nimports = ["import os", "from x import ("]\n#}\npass\n'
    )
    patch = dict(template="fx/bad_import", scope="ToyModel.forward", before="return [h / norm for h in hidden]")
    proj.write_spec(spec_toml(patches=[{**patch, "why": "x"}]))
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert "bad_import.py.j2: imports[1] = 'from x import (' must be one import statement" in err, err
    assert "internal error" not in err


# ---- 5. an output package named like a diffusers pipelines package is refused at regen ----------------------------

needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers not installed")


@needs_diffusers
@pytest.mark.parametrize("folder", ["wan", "flux", "dit", "stable_diffusion_3", "pipeline_utils"])
def test_an_output_package_named_like_a_diffusers_pipelines_package_is_refused(tmp_path, capsys, folder) -> None:
    """diffusers records a pipeline component's library from the second-to-last part of its class's module path:
    `generated.wan.transformer_wan` is recorded as `wan`, i.e. diffusers.pipelines.wan, and cannot be loaded again."""
    proj = make_project(tmp_path / "proj", spec_toml(output=f"generated/{folder}/transformer_x.py"))
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert f"specs/toy.toml: key 'output' = 'generated/{folder}/transformer_x.py'" in err, err
    assert f"diffusers.pipelines.{folder}" in err and f"generated/{folder}_dit/transformer_x.py" in err, err


@needs_diffusers
def test_output_packages_that_only_share_a_transformers_model_name_are_accepted(tmp_path) -> None:
    """transformers never reads a class's module path (its own model folders are `transformers.models.<type>`), so
    `generated/qwen3/` is harmless; the project's specs all pass."""
    for folder in ("qwen3", "llama", "wan_dit", "models", "diffusers", "transformers"):
        proj = make_project(tmp_path / folder, spec_toml(output=f"generated/{folder}/modeling_x.py"))
        load_specs(proj.config, None)
    assert len(load_specs(load_config(REPO), None)) >= 17


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    """No network: the fixture projects' wheels are in their caches."""
    from patchgen import wheels

    def refuse(package: str, version: str, cache: Path) -> Path:
        raise AssertionError(f"unexpected download of {package}=={version}")

    monkeypatch.setattr(wheels, "download_wheel", refuse)
