"""The committed upgrade reports are what a fresh `patchgen upgrade` run writes (needs the wheels: PyPI or cache).

A report covers the models that existed when it was made (its model sections and its list of other packages' specs);
the fresh run is made with exactly those specs, so adding a spec never turns this red (the new model is reported at
the report's next regeneration), while any change of a covered model's result (its spec, a template, the engine,
its checked-in generated files) still does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patchgen.wheels import wheel_cache
from tests.engine.helpers import PLAIN, TOY, VERSION, build_wheel, make_project, record_wheel, run_cli, spec_toml
from tests.engine.test_upgrade import toy_v2

ROOT = Path(__file__).resolve().parents[2]
REPORTS = sorted((ROOT / "docs" / "upgrades").glob("*.md"))
INSERT = dict(  # applies to 2.0.0 too, so its why is in the new body
    template="fx/insert_code", scope="ToyModel.forward", before="if attention_mask is None:", vars=dict(code="probe")
)
PLAIN_SPEC = spec_toml(PLAIN, "generated/plain/plain.py", ["Counter"])


APPENDED = ("\n## Migration (`--migrate`)", "\n## Proof (`--verify`)")


def without_appended(report: str) -> str:
    """The report as `patchgen upgrade --report` alone writes it: the sections `--migrate` and `--verify` append
    at its end are a run's record (proving again takes minutes; test_migrate and test_verify test them) and are cut."""
    return report[: min((i for s in APPENDED if (i := report.find(s)) >= 0), default=len(report))]


def covered_models(report: str) -> list[str]:
    """The specs a report covers: its model sections and the specs of other packages it lists."""
    sections = re.findall(r"^## (\S+)$", report, re.M)
    others = re.search(r"^Specs of other upstream packages, untouched: (.*)\.$", report, re.M)
    return sorted({*(s for s in sections if s != "Patches"), *(others.group(1).split(", ") if others else [])})


def project_copy(tmp_path: Path, models: list[str], source: Path = ROOT, specs: Path | None = None) -> Path:
    """A copy of the project at `source` whose specs are only `models` of `specs` (default: its own), with its
    generated files, templates, pins and wheel cache as they are."""
    project = tmp_path / "project"
    project.mkdir(parents=True)
    for name in ("pyproject.toml", "templates", "generated"):
        src = source / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, project / name)
    (project / "specs").mkdir()
    for model in models:
        shutil.copy((specs or source / "specs") / f"{model}.toml", project / "specs" / f"{model}.toml")
    if (source / ".patchgen-cache").is_dir():  # reuse downloaded wheels; a clean clone downloads once
        shutil.copytree(source / ".patchgen-cache", project / ".patchgen-cache")
    return project


def fresh_report(project: Path, report: Path, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """The Markdown and the diff folder a fresh `patchgen upgrade --report` writes, named like `report`."""
    package, version = re.fullmatch(r"(\w+)-([\w.]+)", report.stem).groups()
    fresh = tmp_path / "fresh.md"
    done = subprocess.run(
        [sys.executable, "-m", "patchgen.cli", "upgrade", "--to", f"{package}=={version}", "--root", str(project)]
        + ["--report", str(fresh)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode == 2 and "download" in done.stderr.lower():
        pytest.skip(f"cannot obtain the {package}=={version} wheel here (no registry access): {done.stderr[-300:]}")
    assert done.returncode in (0, 1), done.stderr
    text = (
        fresh.read_text()
        .replace(f"]({fresh.stem}/", f"]({report.stem}/")
        .replace(f"[{fresh.stem}/", f"[{report.stem}/")
    )
    return text, {p.name: p.read_text() for p in sorted(fresh.with_suffix("").glob("*.diff"))}


# diffusers 0.42.1's review is checked by tests/engine/test_verify.py, whose `upgrade --verify` run writes it anyway
# (one analysis of that release instead of two)
FRESH_ELSEWHERE = ("diffusers-0.42.1",)


@pytest.mark.parametrize("report", [r for r in REPORTS if r.stem not in FRESH_ELSEWHERE], ids=lambda p: p.stem)
def test_committed_report_matches_a_fresh_run(report: Path, tmp_path: Path) -> None:
    committed = without_appended(report.read_text())
    fresh_md, fresh_diffs = fresh_report(project_copy(tmp_path, covered_models(committed)), report, tmp_path)
    again = f"regenerate {report.relative_to(ROOT)} with patchgen upgrade --report"
    assert fresh_md == committed, again
    # the whole generated-file diffs live beside the report, one file per model whose body changes
    diffs = {p.name: p.read_text() for p in sorted(report.with_suffix("").glob("*.diff"))}
    assert fresh_diffs == diffs, again
    for name in diffs:
        assert f"]({report.stem}/{name})" in fresh_md


@pytest.fixture
def fixture_release(tmp_path: Path, capsys) -> tuple[Path, Path, Path]:
    """A fixture project of two specs generated from fixturepkg 1.2.3, its committed report of 2.0.0, and a clone of
    its specs with one spec more (the state after a colleague adds a spec)."""
    source = make_project(
        tmp_path / "source", {"toy": spec_toml(patches=[{**INSERT, "why": "x"}]), "plain": PLAIN_SPEC}
    ).root
    build_wheel(wheel_cache(source), VERSION)
    record_wheel(source, build_wheel(wheel_cache(source), "2.0.0", {TOY: toy_v2()}))
    assert run_cli(source, capsys, "regen", "--all", "--from", f"fixturepkg=={VERSION}")[0] == 0
    report = tmp_path / "docs" / "fixturepkg-2.0.0.md"
    report.parent.mkdir()
    fresh = fresh_report(project_copy(tmp_path / "first", ["plain", "toy"], source), report, tmp_path / "first")[0]
    report.write_text(fresh)
    clone = shutil.copytree(source / "specs", tmp_path / "clone_specs")
    (clone / "added.toml").write_text(
        spec_toml(output="generated/added/modeling_toy.py", patches=[{**INSERT, "why": "x"}])
    )
    return source, report, clone


def test_a_new_spec_leaves_the_committed_report_valid(fixture_release, tmp_path: Path) -> None:
    """Before, the fresh run used every spec of specs/: one more spec turned `make test` red until someone
    regenerated the report by hand (the first comparison below is that old test; it differs)."""
    source, report, clone = fixture_release
    committed = report.read_text()
    everything = project_copy(tmp_path / "old", ["added", "plain", "toy"], source, clone)
    assert fresh_report(everything, report, tmp_path / "old")[0] != committed
    covered = project_copy(tmp_path / "new", covered_models(committed), source, clone)
    assert covered_models(committed) == ["plain", "toy"]
    assert fresh_report(covered, report, tmp_path / "new")[0] == committed


def test_a_changed_covered_model_still_fails_the_comparison(fixture_release, tmp_path: Path) -> None:
    source, report, clone = fixture_release
    committed = report.read_text()
    (clone / "toy.toml").write_text(spec_toml(patches=[{**INSERT, "why": "reworded"}]))
    covered = project_copy(tmp_path / "changed", covered_models(committed), source, clone)
    assert fresh_report(covered, report, tmp_path / "changed")[0] != committed


def test_covered_models_are_read_from_the_report() -> None:
    report = (
        "## Patches\n\n## flux\n\n### Generated file\n\n## wan\n\n"
        "Specs of other upstream packages, untouched: llama, qwen3.\n"
    )
    assert covered_models(report) == ["flux", "llama", "qwen3", "wan"]


def test_the_sections_of_migrate_and_verify_are_not_compared() -> None:
    base = "# Upgrade review\n\n## Patches\n\n## flux\n"
    proof = "\n## Proof (`--verify`)\n\n| flux | 7 of 7 | proven | 9 |\n"
    assert without_appended(base) == base
    assert without_appended(base + proof) == base
    assert without_appended(base + "\n## Migration (`--migrate`)\n\nx\n" + proof) == base
