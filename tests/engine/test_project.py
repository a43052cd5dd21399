"""Project-level guarantees: deterministic bytes, idempotent regen, check right after regen, atomic writes."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap

import pytest

from patchgen.errors import PatchgenError
from patchgen.files import write_atomic
from patchgen.journal import Confinement
from patchgen.project import check, regen
from patchgen.spec_set import load_specs
from tests.engine.helpers import ALL_OPS, REPO, FixtureSource, spec_toml

# Generates the every-op spec and a rename spec in a fresh temp project and prints the sha256 of all outputs.
DETERMINISM_SCRIPT = textwrap.dedent("""
    import hashlib, sys, tempfile
    from pathlib import Path
    from patchgen.project import regen
    from patchgen.spec_set import load_specs
    from tests.engine.helpers import ALL_OPS, FixtureSource, make_project, spec_toml

    rename = [dict(template="core/rename", scope="ToyLayer", vars=dict(to="SPToyLayer"), why="r")]
    root = Path(tempfile.mkdtemp()) / "somewhere"
    proj = make_project(root, {"toy": spec_toml(patches=ALL_OPS),
                               "renamed": spec_toml(output="generated/renamed/modeling_toy.py", patches=rename)})
    regen(proj.config, load_specs(proj.config, None), source=FixtureSource())
    digest = hashlib.sha256()
    for path in sorted((root / "generated").rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\\0" + path.read_bytes() + b"\\0")
    print(digest.hexdigest())
""")


def run_determinism(cwd, seed: str) -> str:
    """The script's digest, run in a fresh interpreter with this working directory and hash seed."""
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", DETERMINISM_SCRIPT], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_output_bytes_are_identical_across_runs_cwds_and_hash_seeds(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "deeper").mkdir(parents=True)
    first, second = run_determinism(tmp_path / "a", "0"), run_determinism(tmp_path / "b" / "deeper", "4242")
    assert len(first) == 64 and first == second
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # and in this process (pytest's own random hash seed, cwd)
        exec(DETERMINISM_SCRIPT, {})
    assert printed.getvalue().strip() == first


def test_regen_is_idempotent_and_check_passes_right_after(project) -> None:
    proj = project(
        {
            "toy": spec_toml(patches=ALL_OPS),
            "other": spec_toml(output="generated/other/modeling_other.py", keep=["ToyConfig"]),
        }
    )
    config, source = proj.config, FixtureSource()
    specs = load_specs(config, None)
    first = regen(config, specs, source=source)
    written = {c.path.relative_to(config.root).as_posix(): c.status for c in first}
    assert written == {
        "generated/__init__.py": "new",
        "generated/other/__init__.py": "new",
        "generated/other/modeling_other.py": "new",
        "generated/other/modeling_other.py.diff": "new",
        "generated/toy/__init__.py": "new",
        "generated/toy/modeling_toy.py": "new",
        "generated/toy/modeling_toy.py.diff": "new",
    }
    snapshot = proj.snapshot()
    second = regen(config, load_specs(config, None), source=source)
    assert {c.status for c in second} == {"unchanged"} and len(second) == len(first)
    assert proj.snapshot() == snapshot  # unchanged files are not rewritten (mtimes too)
    assert check(config, specs, source=source) == []
    assert check(config, specs, full=True, source=source) == []


def test_written_diff_is_the_review_diff_against_upstream(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    regen(proj.config, [proj.spec()], source=FixtureSource())
    diff = (proj.root / "generated/toy/modeling_toy.py.diff").read_text()
    assert diff.startswith(
        "--- a/fixturepkg/models/modeling_toy.py (fixturepkg==1.2.3)\n+++ b/generated/toy/modeling_toy.py\n"
    )
    assert "\n-from ..util import clamp, make_registry\n" in diff
    assert "\n+from fixturepkg.util import clamp, make_registry\n" in diff
    assert "-class UnusedThing:\n" in diff


def test_check_reports_hand_edits_and_stale_diffs(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    config, source = proj.config, FixtureSource()
    regen(config, [proj.spec()], source=source)
    target = proj.root / "generated/toy/modeling_toy.py"
    original = target.read_text()
    target.write_text(original.replace("return [0.5] * length", "return [0.6] * length"))
    drifts = check(config, [proj.spec()], source=source)
    assert [d.path for d in drifts] == [target]
    assert "edited by hand" in drifts[0].reason and "+        return [0.5] * length" in drifts[0].diff
    target.write_text(original)
    diff = target.with_name("modeling_toy.py.diff")
    diff.write_text(diff.read_text() + " ")
    assert [d.path for d in check(config, [proj.spec()], source=source)] == [diff]


def test_check_notices_a_changed_input(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    config = proj.config
    regen(config, [proj.spec()], source=FixtureSource())
    changed = FixtureSource(
        overrides={
            "fixturepkg.models.modeling_toy": (REPO / "tests/fixtures/upstream/fixturepkg/models/modeling_toy.py")
            .read_text()
            .replace("EPS   =", "EPS =")
        }
    )
    drifts = check(config, [proj.spec()], source=changed)
    assert len(drifts) == 2 and "upstream source" in drifts[0].reason


def test_regen_with_one_good_and_one_bad_spec_writes_nothing(project) -> None:
    bad = dict(
        template="fx/insert_code",
        scope="ToyModel.forward",
        after="no_such_statement()",
        vars=dict(code="nothing"),
        why="x",
    )
    proj = project(
        {
            "a_good": spec_toml(output="generated/good/modeling_toy.py", patches=ALL_OPS),
            "b_bad": spec_toml(output="generated/bad/modeling_toy.py", patches=[bad]),
        }
    )
    before = proj.snapshot()
    with pytest.raises(PatchgenError, match="b_bad.toml: patch 1 .* matches no statement"):
        regen(proj.config, load_specs(proj.config, None), source=FixtureSource())
    assert proj.snapshot() == before
    assert not (proj.root / "generated").exists()


def test_anchor_error_leaves_existing_outputs_untouched(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    regen(proj.config, [proj.spec()], source=FixtureSource())
    before = proj.snapshot()
    broken = [*ALL_OPS[:-1], {**ALL_OPS[-1], "before": "if labels is None:"}]
    proj.write_spec(spec_toml(patches=broken))
    spec_file = "specs/toy.toml"
    before[spec_file] = proj.snapshot()[spec_file]
    with pytest.raises(PatchgenError, match="patch 8 .* matches no statement"):
        regen(proj.config, [proj.spec()], source=FixtureSource())
    assert proj.snapshot() == before


def test_dry_run_reports_but_writes_nothing(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    before = proj.snapshot()
    changes = regen(proj.config, [proj.spec()], dry_run=True, source=FixtureSource())
    assert {c.status for c in changes} == {"new"}
    assert proj.snapshot() == before


def test_write_atomic_stages_everything_before_replacing_anything(tmp_path) -> None:
    keep = tmp_path / "a.py"
    keep.write_text("old\n")
    (tmp_path / "blocker").write_text("a file where a directory is needed\n")
    paths = [keep, tmp_path / "blocker" / "b.py", tmp_path / "sub" / "c.py"]
    allowed = Confinement(tmp_path, tmp_path, frozenset(paths))
    with pytest.raises(PatchgenError, match="blocker: not a directory; nothing was changed"):
        write_atomic({keep: "new\n", tmp_path / "blocker" / "b.py": "x\n"}, allowed)
    assert keep.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "blocker"]  # no temp files left behind
    write_atomic({keep: "new\n", tmp_path / "sub" / "c.py": "c\n"}, allowed)
    assert keep.read_text() == "new\n" and (tmp_path / "sub" / "c.py").read_text() == "c\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "blocker", "sub"]
