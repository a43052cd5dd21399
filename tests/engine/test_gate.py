"""The drift gate cannot be fooled (issue 11, items 5 and 9): CI proves every body from its inputs, so a header whose
hashes were recomputed after an edit fails; and the engine hash covers every module that can change output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from patchgen import provenance as generate_module
from patchgen.header import BEGIN, END, body_hash
from patchgen.project import check, regen
from patchgen.provenance import ENGINE_FILES, FRONT_ENDS, unified_diff
from patchgen.spec_set import load_specs
from tests.engine.helpers import ALL_OPS, REPO, FixtureSource, spec_toml

PACKAGE = REPO / "patchgen"


def forge(target: Path, source: FixtureSource, relpath: str) -> None:
    """Edit the body, then make every hash the fast check reads agree with the edit (header and review diff)."""
    text = target.read_text()
    text = text.replace("return [0.5] * length", "return [0.6] * length")
    head, body = text.split(END + "\n", 1)
    head = re.sub(r"# body: sha256=\w+", f"# body: sha256={body_hash(body)}", head)
    forged = head + END + "\n" + body
    target.write_text(forged)
    upstream = source.read("fixturepkg.models.modeling_toy")
    target.with_name(target.name + ".diff").write_text(unified_diff(upstream, forged, relpath))


def test_a_forged_header_passes_the_fast_check_and_fails_the_full_one(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    config, source = proj.config, FixtureSource()
    specs = load_specs(config, None)
    regen(config, specs, source=source)
    target = proj.root / "generated/toy/modeling_toy.py"
    forge(target, source, "generated/toy/modeling_toy.py")
    assert target.read_text().startswith(BEGIN) and "[0.6] * length" in target.read_text()
    assert check(config, specs, source=source) == []  # the hash-only check believes the header (pre-commit)
    drifts = check(config, specs, full=True, source=source)
    assert [d.path for d in drifts] == [target, target.with_name("modeling_toy.py.diff")]
    assert drifts[0].reason == (
        "the body is not what the spec, templates and upstream produce, although its header's hashes say it is "
        "(edited and re-hashed by hand?); run `patchgen regen toy`"
    )
    assert "-        return [0.6] * length" in drifts[0].diff and "+        return [0.5] * length" in drifts[0].diff


def test_ci_runs_the_full_check_and_precommit_the_fast_one() -> None:
    """`make test` runs the whole suite, no selection, and the suite runs `check --full` on a copy of this project
    (tests/engine/test_cli.py, without torch); pre-commit runs the fast check."""
    from tests.engine import test_cli

    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert recipe.splitlines()[-1] == "\t$(PYTEST) $(XDIST)"
    assert 'for extra in ([], ["--full"]):' in test_cli.CHECK_WITHOUT_TORCH
    assert "real" in test_cli.test_check_passes_and_never_imports_torch_or_transformers.__code__.co_varnames
    hooks = (REPO / ".pre-commit-hooks.yaml").read_text()
    assert "entry: patchgen check\n" in hooks


def test_engine_files_are_every_module_but_the_front_ends() -> None:
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    packages = [entry for entry in FRONT_ENDS if entry.endswith("/")]  # every module under them
    front = {m for m in modules if m in FRONT_ENDS or any(m.startswith(p) for p in packages)}
    assert set(FRONT_ENDS) - set(packages) <= set(modules) and all(
        any(m.startswith(p) for m in modules) for p in packages
    )
    assert list(ENGINE_FILES) == [m for m in modules if m not in front]
    assert "migrate_rules/delegate.py" in front
    assert {"spec.py", "upstream.py", "files.py", "project.py", "templates.py", "generate.py"} <= set(ENGINE_FILES)


IMPORTED_BY_GENERATION = textwrap.dedent("""
    import sys, tempfile
    from pathlib import Path
    from patchgen.project import regen
    from patchgen.spec_set import load_specs
    from tests.engine.helpers import ALL_OPS, FixtureSource, make_project, spec_toml

    proj = make_project(Path(tempfile.mkdtemp()) / "p", spec_toml(patches=ALL_OPS))
    regen(proj.config, load_specs(proj.config, None), source=FixtureSource())
    print(" ".join(sorted(m for m in sys.modules if m == "patchgen" or m.startswith("patchgen."))))
""")


def test_every_module_generation_imports_is_hashed() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", IMPORTED_BY_GENERATION], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    imported = result.stdout.split()
    assert "patchgen.project" in imported and "patchgen.cst.plan" in imported
    for module in imported:
        relative = module.removeprefix("patchgen").lstrip(".").replace(".", "/")
        path = PACKAGE / relative / "__init__.py" if (PACKAGE / relative).is_dir() else PACKAGE / f"{relative}.py"
        assert path.relative_to(PACKAGE).as_posix() in ENGINE_FILES, module


def test_the_engine_hash_changes_with_any_engine_module(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "patchgen"
    for name in ENGINE_FILES:
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_bytes((PACKAGE / name).read_bytes())
    monkeypatch.setattr(generate_module, "PACKAGE_DIR", fake)
    generate_module.engine_sha256.cache_clear()
    try:
        baseline = generate_module.engine_sha256()
        for name in ("files.py", "upstream.py", "spec.py"):
            original = (fake / name).read_bytes()
            (fake / name).write_bytes(original + b"\n# changed\n")
            generate_module.engine_sha256.cache_clear()
            assert generate_module.engine_sha256() != baseline, name
            (fake / name).write_bytes(original)
    finally:
        generate_module.engine_sha256.cache_clear()
