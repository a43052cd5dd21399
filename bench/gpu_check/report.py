"""results.json, results.md and the table printed last: what a reader of the run's log sees first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def line(record: dict[str, Any]) -> str:
    """One step's result in a line: its headline figures, or why it was skipped / how it failed."""
    if record["status"] == "skipped":
        return f"skipped: {record['reason']}"
    if record["status"] == "failed":
        return f"failed: {record['error'].splitlines()[0]}"
    return record.get("summary", "")


def table(results: dict[str, Any]) -> str:
    v = results["versions"]
    head = (
        f"gpu_check ({results['mode']}, {results['size']} sizes, {results['total_seconds']} s): {v['device']}; "
        f"torch {v['torch']} CUDA {v['cuda']} triton {v['triton']} transformers {v['transformers']} "
        f"diffusers {v['diffusers']}"
    )
    rows = ["| step | status | seconds / budget | result |", "|---|---|---|---|"]
    for r in results["steps"]:
        rows.append(f"| {r['step']} | {r['status']} | {r['seconds']:.0f} / {r['budget_s']} | {line(r)} |")
    return "\n".join([head, "", *rows])


def write(results: dict[str, Any], out: Path) -> str:
    """Write results.json (everything, tracebacks included) and results.md (the table); return the table."""
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = table(results)
    failures = [f"### {r['step']}\n\n```\n{r['trace']}```" for r in results["steps"] if r["status"] == "failed"]
    (out / "results.md").write_text("# GPU check\n\n" + text + "\n" + "".join(f"\n{f}\n" for f in failures))
    return text
