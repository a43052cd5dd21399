"""Hostile findings, round 4 (engine): each test failed on the code before its fix.

1. `upgrade --verify` installed unmet requirements from the writable wheel cache without a hash check;
2. an `expr` spec value could hold a call that the generated module runs (and `--migrate --verify` imports it);
3. staging a spec (or a report) beside its file followed a symlink planted at the staging name;
4. a template rendering invalid Python printed libcst's multi-line parser dump;
5. a spec whose output package is named like a diffusers pipelines package made saved pipelines unloadable.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patchgen.files import write_text_atomic
from tests.engine.helpers import run_cli
from tests.engine.test_migrate import HEAD, MOVED, NEW_V, setup

# ---- 3. staging files are created exclusively, never through a planted symlink -----------------------------------


def test_apply_specs_does_not_write_through_a_symlink_planted_at_the_staging_name(tmp_path, capsys) -> None:
    proj, _ = setup(tmp_path / "proj", MOVED, [dict(template="mig/head_var", **HEAD)])
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


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    """No network: the fixture projects' wheels are in their caches."""
    from patchgen import wheels

    def refuse(package: str, version: str, cache: Path) -> Path:
        raise AssertionError(f"unexpected download of {package}=={version}")

    monkeypatch.setattr(wheels, "download_wheel", refuse)
