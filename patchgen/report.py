"""The upgrade report: a console table and a Markdown file, both deterministic (no times, no absolute paths)."""

from __future__ import annotations

from pathlib import Path

from patchgen.files import write_text_atomic
from patchgen.upgrade import ModelResult, Upgrade
from patchgen.upgrade_status import PatchStatus

COLUMNS = ("model", "patch", "scope", "status", "detail")


def rows(upgrade: Upgrade) -> list[tuple[str, str, str, str, str]]:
    """One row per model and patch, plus one per model-level problem."""
    out = []
    for model in upgrade.models:
        for status in model.patches:
            out.append(
                (model.spec.name, _label(status), status.scope or status.patch.where, status.status, status.detail)
            )
        if model.problem:
            out.append((model.spec.name, "-", "-", model.problem.split(":", 1)[0], _first_line(model.problem)))
    return out


def _label(status: PatchStatus) -> str:
    return f"#{status.patch.index} {status.patch.template.name}"


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def verdict(upgrade: Upgrade) -> str:
    patches = [s for m in upgrade.models for s in m.patches]
    applying = sum(s.applies for s in patches)
    broken = [m.spec.name for m in upgrade.models if not m.ok]
    head = f"{applying} of {len(patches)} patches apply in {len(upgrade.models)} model(s)"
    if not broken:
        return f"{head}; `--apply` would update generated/ and the pins"
    return f"{head}; not applying: {', '.join(broken)} (`--apply` refuses, exit 1)"


def console(upgrade: Upgrade) -> str:
    table = [COLUMNS, *rows(upgrade)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(COLUMNS[-1]))
    others = f"\nunaffected specs (other upstream packages): {', '.join(upgrade.others)}" if upgrade.others else ""
    return f"upgrade {', '.join(upgrade.moves())}\n\n" + "\n".join(lines) + f"\n\n{verdict(upgrade)}{others}\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _fence(text: str, lang: str = "diff") -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{lang}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{fence}\n"


def markdown(upgrade: Upgrade, diffs: str | None = None) -> str:
    """The report. With `diffs` (a folder relative to the report), each model's whole generated-file diff is left
    out and linked as `<diffs>/<model>.diff` (see `generated_diffs`), so the report stays readable: the per-patch
    table and the patched regions first."""
    out = [
        f"# Upgrade review: {', '.join(upgrade.moves())}",
        "",
        f"Made by `{upgrade.command}`; a fresh run writes the same bytes (the review files land in "
        f"`upgrade-review/{upgrade.name}/`).",
        "",
    ]
    for wheel in upgrade.wheels:
        out.append(f"- wheel `{wheel.path.name}` sha256 `{wheel.sha256}`")
    out += ["", f"**{verdict(upgrade)}.**", ""]
    if upgrade.others:
        out += [f"Specs of other upstream packages, untouched: {', '.join(upgrade.others)}.", ""]
    out += [
        "Statuses: `applied`; `replaced code changed` (applies, but upstream changed the code it replaces); "
        "`anchor moved` (the anchor matches nothing: the nearest candidate and its new line are given); "
        "`anchor ambiguous`; `scope missing`; `scope mismatch`; `conflict`; `render error`; "
        "`module missing` and `generation error` (the model as a whole).",
        "",
        "## Patches",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows(upgrade)]
    for model in upgrade.models:
        out += ["", *_model_section(model, diffs)]
    return "\n".join(out).rstrip("\n") + "\n"


def generated_diffs(upgrade: Upgrade) -> dict[str, str]:
    """Model name -> the diff from its checked-in body to the new one, for every model whose body changes."""
    return {
        model.spec.name: diff
        for model in upgrade.models
        if model.generated is not None and not model.unchanged and (diff := model.output_diff())
    }


def _model_section(model: ModelResult, diffs: str | None = None) -> list[str]:
    spec = model.spec
    old = model.old.pin if model.old else "the pinned release (unreadable)"
    new = model.new.pin if model.new else "the new release"
    out = [f"## {spec.name}", "", f"`{spec.module}`: {old} -> {new}; output `{spec.output}`.", ""]
    if spec.companions:
        out += [
            f"- companion `{c.module}`: output `{c.output}` (redefines {', '.join(c.keep)})" for c in spec.companions
        ]
        out.append("")
    if model.problem:
        out += ["Problem:", "", _fence(model.problem, "text")]
    for status in model.patches:
        if status.candidates:
            out.append(f"- #{status.patch.index} {status.status}; nearest candidates in {new}:")
            out += [f"  - line {line}: `{text}`" for line, text in status.candidates]
    if any(s.candidates for s in model.patches):
        out.append("")
    out += ["### Upstream changes in the patched regions", ""]
    if not model.regions:
        out += ["No patched region to compare.", ""]
    for region in model.regions:
        span = _span(region.old_lines) + " -> " + _span(region.new_lines)
        gone = f"gone in {new}, compared with the nearest definition `{region.near}`: " if region.near else ""
        if region.diff:
            out += [""] if out[-1] else []  # an HTML block needs a blank line before it
            out += [
                f"<details><summary><code>{region.scope}</code> (lines {span}): {gone}changed</summary>",
                "",
                _fence(region.diff),
                "</details>",
                "",
            ]
        elif region.old_lines and region.new_lines:
            out.append(f"- `{region.scope}` (lines {span}): {gone}unchanged")
        else:
            what = f"not in {new}" if region.new_lines is None else f"not found in {old}"
            out.append(f"- `{region.scope}` (lines {span}): {what}")
    out.append("")
    out += ["### Generated file", ""]
    if model.generated is None:
        out += ["Not generated (see the problem above).", ""]
        return out
    skipped = ", ".join(f"#{p.index}" for p in model.skipped)
    if skipped:
        out += [f"Partial: built without patch(es) {skipped}, which do not apply; never written to generated/.", ""]
    diff = model.output_diff()
    if model.unchanged:
        out += [f"`{spec.output}`{' and its companions' if spec.companions else ''}: unchanged.", ""]
    elif not diff and spec.companions:
        out += [f"`{spec.output}` and its companions: bodies unchanged; only the provenance headers differ.", ""]
    elif not diff:
        out += [f"`{spec.output}`: body unchanged; only the provenance header differs.", ""]
    else:
        count = sum(1 for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        if diffs is not None:
            link = f"{diffs}/{spec.name}.diff"
            return [
                *out,
                f"`{spec.output}`: checked-in body -> new body, {count} lines changed: [{link}]({link}).",
                "",
            ]
        out += [
            f"<details><summary><code>{spec.output}</code>: checked-in body -> new body ({count} lines "
            f"changed; provenance header left out)</summary>",
            "",
            _fence(diff),
            "</details>",
            "",
        ]
    return out


def _span(lines: tuple[int, int] | None) -> str:
    return "-" if lines is None else f"{lines[0]}-{lines[1]}"


def write_report(path: Path, text: str, diffs: dict[str, str]) -> None:
    """The report and, in the folder named like it, one `<model>.diff` per model whose generated body changes;
    `.diff` files a previous run left there for models that no longer change are removed (the folder is the
    report's own)."""
    folder = path.with_suffix("")
    for stale in sorted(folder.glob("*.diff")) if folder.is_dir() else []:
        if stale.stem not in diffs:
            stale.unlink()
    for name, diff in sorted(diffs.items()):
        write_text_atomic(folder / f"{name}.diff", diff)
    write_text_atomic(path, text)
