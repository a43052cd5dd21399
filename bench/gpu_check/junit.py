"""The CUDA tests' outcome read from pytest's JUnit XML (pytest writes it itself: no plugin to keep working)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def summary(path: Path) -> dict[str, Any]:
    """Counts of passed / failed / skipped tests and each test's outcome (with the skip reason or failure line)."""
    tests: list[dict[str, str]] = []
    if path.exists():
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome, detail = "passed", ""
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = "skipped" if tag == "skipped" else "failed"
                    detail = (found.get("message") or "").splitlines()[0][:200] if found.get("message") else ""
                    break
            tests.append({"test": name, "outcome": outcome, "detail": detail})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {**counts, "tests": tests}
