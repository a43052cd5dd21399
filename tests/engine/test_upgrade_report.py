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

ROOT = Path(__file__).resolve().parents[2]
REPORTS = sorted((ROOT / "docs" / "upgrades").glob("*.md"))
DIFFUSERS = next(r for r in REPORTS if r.stem.startswith("diffusers-"))


def covered_models(report: str) -> list[str]:
    """The specs a report covers: its model sections and the specs of other packages it lists."""
    sections = re.findall(r"^## (\S+)$", report, re.M)
    others = re.search(r"^Specs of other upstream packages, untouched: (.*)\.$", report, re.M)
    return sorted({*(s for s in sections if s != "Patches"), *(others.group(1).split(", ") if others else [])})


def project_copy(tmp_path: Path, models: list[str], specs: Path = ROOT / "specs") -> Path:
    """The project with only `models` of `specs` as its specs (the generated files, templates and pins as they are)."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "templates", "generated"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, project / name)
    (project / "specs").mkdir()
    for model in models:
        shutil.copy(specs / f"{model}.toml", project / "specs" / f"{model}.toml")
    if (ROOT / ".patchgen-cache").is_dir():  # reuse downloaded wheels; a clean clone downloads once
        shutil.copytree(ROOT / ".patchgen-cache", project / ".patchgen-cache")
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


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.stem)
def test_committed_report_matches_a_fresh_run(report: Path, tmp_path: Path) -> None:
    committed = report.read_text()
    fresh_md, fresh_diffs = fresh_report(project_copy(tmp_path, covered_models(committed)), report, tmp_path)
    again = f"regenerate {report.relative_to(ROOT)} with patchgen upgrade --report"
    assert fresh_md == committed, again
    # the whole generated-file diffs live beside the report, one file per model whose body changes
    diffs = {p.name: p.read_text() for p in sorted(report.with_suffix("").glob("*.diff"))}
    assert fresh_diffs == diffs, again
    for name in diffs:
        assert f"]({report.stem}/{name})" in fresh_md


def test_a_new_spec_leaves_the_committed_report_valid(tmp_path: Path) -> None:
    """Before, every spec in specs/ was compared: a new one turned `make test` red until someone regenerated it."""
    committed = DIFFUSERS.read_text()
    models = covered_models(committed)
    specs = shutil.copytree(ROOT / "specs", tmp_path / "clone_specs")  # the specs of a clone with one more spec
    base = next(m for m in models if f"## {m}\n" in committed)
    text = (specs / f"{base}.toml").read_text()
    output = re.search(r'^output = "(.*)"$', text, re.M).group(1)
    (specs / "zz_added.toml").write_text(text.replace(output, "generated/zz_added/added.py"))
    assert "zz_added" not in models
    assert fresh_report(project_copy(tmp_path, models, specs), DIFFUSERS, tmp_path)[0] == committed


def test_a_changed_covered_model_still_fails_the_comparison(tmp_path: Path) -> None:
    committed = DIFFUSERS.read_text()
    models = covered_models(committed)
    project = project_copy(tmp_path, models)
    base = next(m for m in models if f"## {m}\n" in committed)
    spec = project / "specs" / f"{base}.toml"
    text = spec.read_text()
    why = re.search(r'^why = "(.*)"$', text, re.M).group(1)
    spec.write_text(text.replace(f'why = "{why}"', f'why = "{why}, reworded"', 1))
    assert fresh_report(project, DIFFUSERS, tmp_path)[0] != committed


def test_covered_models_are_read_from_the_report() -> None:
    report = (
        "## Patches\n\n## flux\n\n### Generated file\n\n## wan\n\n"
        "Specs of other upstream packages, untouched: llama, qwen3.\n"
    )
    assert covered_models(report) == ["flux", "llama", "qwen3", "wan"]
