"""Every spec is covered by every committed upgrade report (docs/upgrades/*.md): as a model section of its package's
report, or in the other reports' list of other packages' specs. test_upgrade_report compares a report with a fresh run
over the specs it covers, so a spec added later would otherwise stay unreviewed against the release for good; this
test reads the reports' text only (no wheel, no run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_upgrade_report import REPORTS, ROOT, covered_models


def test_there_are_reports() -> None:
    assert REPORTS, "docs/upgrades/ holds no report"


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.stem)
def test_every_spec_is_covered_by_the_report(report: Path) -> None:
    specs = sorted(path.stem for path in (ROOT / "specs").glob("*.toml"))
    missing = sorted(set(specs) - set(covered_models(report.read_text())))
    package, _, version = report.stem.rpartition("-")
    assert not missing, (
        f"{report.relative_to(ROOT)} does not cover {', '.join(missing)}: regenerate it with `patchgen upgrade "
        f"--to {package}=={version} --report {report.relative_to(ROOT)}` (docs/upgrading-transformers.md)"
    )
