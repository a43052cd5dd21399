"""`patchgen` command line. Exit codes: 0 ok, 1 drift, 2 user error.

libcst, jinja2's compiler and the upgrade machinery are imported by the commands that need them, so the drift
check (`patchgen check`, a pre-commit hook) starts fast.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated

import typer

from patchgen.config import ProjectConfig, load_config
from patchgen.draft.command import draft
from patchgen.errors import PatchgenError
from patchgen.ownership import ORPHAN, finish_interrupted_write
from patchgen.project import check as check_project
from patchgen.project import regen as regen_project
from patchgen.spec_set import load_specs, with_dependents
from patchgen.upstream import InstalledSource, PinnedSource, WheelSource, normalize_name
from patchgen.wheels import obtain_all, wheel_cache

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # plain click help: rich's renderer labels every flag `<bool>` and reads a docstring's `[model.data]` as markup
    rich_markup_mode=None,
    help="Generate reviewable training variants of upstream modeling code from declarative specs.",
)
app.command()(draft)  # patchgen/draft/: a front end that writes a spec
RootOption = Annotated[Path | None, typer.Option("--root", help="project root (default: found from the cwd)")]
FromOption = Annotated[
    list[str] | None,
    typer.Option(
        "--from",
        help="read a pinned upstream package from a wheel instead of the installed package: a .whl path, or "
        "package==version (taken from the wheel cache, downloaded on a miss); repeatable",
    ),
]


def open_project(root: Path | None) -> ProjectConfig:
    """The project's configuration, after finishing any write a killed patchgen process left half done."""
    config = load_config(root)
    outcome = finish_interrupted_write(config)
    if outcome == "discarded":
        typer.echo("note: removed the leftovers of an interrupted write (.patchgen-txn/)", err=True)
    elif outcome is not None:
        typer.echo(f"note: finished an interrupted write ({outcome}: .patchgen-txn/journal.json)", err=True)
    return config


def pinned_source(config: ProjectConfig, froms: list[str] | None) -> PinnedSource:
    """The pinned releases, installed or (`--from`) read from wheels; a wheel of another version is refused."""
    if not froms:
        return PinnedSource(config.pins)
    wheels = [
        wheel for wheel, _ in obtain_all(froms, config.pins, wheel_cache(config.root), "--from", config.wheel_sha256)
    ]
    pins = {normalize_name(name): version for name, version in config.pins.items()}
    for wheel in wheels:
        if wheel.version != pins[wheel.package]:
            raise PatchgenError(
                f"--from {wheel.path.name} is {wheel.pin} but the pin is {wheel.package}=="
                f"{pins[wheel.package]}; generated files derive from the pinned release. To move to "
                f"{wheel.version}, review it with `patchgen upgrade --to {wheel.pin}`"
            )
    return PinnedSource(config.pins, WheelSource(wheels, fallback=InstalledSource()))


@app.command()
def regen(
    models: Annotated[list[str] | None, typer.Argument(help="models (spec names) to regenerate")] = None,
    all_: Annotated[bool, typer.Option("--all", help="regenerate every spec")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="report what would change, write nothing")] = False,
    from_: FromOption = None,
    root: RootOption = None,
) -> None:
    """Regenerate generated/ files (and their .diff) from specs, templates and the pinned upstream."""
    if bool(models) == all_:
        raise PatchgenError("name the models to regenerate, or pass --all (not both)")
    config = open_project(root)
    specs = load_specs(config, None if all_ else models)
    if not all_:  # a spec that `extends` a regenerated one inherits its change: regenerate it too
        specs = with_dependents(config, specs)
    changes = regen_project(config, specs, dry_run=dry_run, source=pinned_source(config, from_))
    verb = "would write" if dry_run else "wrote"
    for change in changes:
        rel = change.path.relative_to(config.root)
        if change.status == "orphan":
            typer.echo(f"   orphan  {rel}  ({ORPHAN})", err=True)
        else:
            typer.echo(f"{change.status:>9}  {rel}" + (f"  ({verb})" if change.status != "unchanged" else ""))
    if any(change.status == "orphan" for change in changes):
        raise typer.Exit(1)


@app.command()
def check(
    models: Annotated[list[str] | None, typer.Argument(help="models to check (default: all)")] = None,
    full: Annotated[bool, typer.Option("--full", help="regenerate even when hashes prove freshness")] = False,
    from_: FromOption = None,
    root: RootOption = None,
) -> None:
    """Fail (exit 1) when a generated file differs from what spec + templates + pinned upstream produce."""
    config = open_project(root)
    specs = load_specs(config, models)
    drifts = check_project(config, specs, full=full, source=pinned_source(config, from_))
    for drift in drifts:
        typer.echo(f"DRIFT {drift.path.relative_to(config.root)}: {drift.reason}", err=True)
        if drift.diff:
            typer.echo(drift.diff, err=True)
    if drifts:
        raise typer.Exit(1)
    where = config.generated_dir.relative_to(config.root) if config.generated_dir.is_relative_to(config.root) else None
    typer.echo(f"ok: {len(specs)} spec(s) match {where.as_posix() if where else config.generated_dir}/")


@app.command("list")
def list_models(root: RootOption = None) -> None:
    """Specs: model, upstream module, output, patch count (and released models, where its [model.data] names them)."""
    config = open_project(root)
    for spec in load_specs(config, None):
        companions = f" (+ {', '.join(Path(c.output).name for c in spec.companions)})" if spec.companions else ""
        typer.echo(f"{spec.name:<16} {spec.module:<56} {spec.output}{companions}  ({len(spec.patches)} patches)")
        released = spec.model.data.get("released") if spec.model is not None else None
        if released:  # the released models one spec serves (its [model.data] released)
            typer.echo(f"{'':<16} serves: {', '.join(released)}")


@app.command()
def diff(model: str, root: RootOption = None) -> None:
    """Print the unified diff from upstream to each generated file (its companions' too), as regenerated now."""
    config = open_project(root)
    [spec] = load_specs(config, [model])
    from patchgen.generate import generate

    for one in generate(spec, PinnedSource(config.pins), config).files:
        typer.echo(one.diff, nl=False)


@app.command()
def explain(model: str, root: RootOption = None) -> None:
    """Every patch: template and op, scope, the upstream line of its anchor, why, and the rendered code."""
    config = open_project(root)
    [spec] = load_specs(config, [model])
    from patchgen.generate import explain as explain_spec

    upstream, patches = explain_spec(spec, PinnedSource(config.pins))
    typer.echo(f"{spec.name}: {spec.path.name} -> {spec.output} from {upstream.pin} {upstream.relpath}")
    for companion in spec.companions:
        typer.echo(f"  companion {companion.module} -> {companion.output} (redefines {', '.join(companion.keep)})")
    for p in patches:
        where = f" of {p.upstream_path}" if p.upstream_path else ""
        typer.echo(f"\n#{p.index} {p.template} (op {p.op}) @ {p.scope}, upstream line {p.upstream_line}{where}")
        typer.echo(f"  why: {p.why}")
        if p.anchor:
            typer.echo(f"  anchor: {p.anchor}")
        typer.echo("  rendered:")
        typer.echo("\n".join(f"    | {line}" for line in p.rendered.splitlines()))


@app.command()
def upgrade(
    to: Annotated[
        list[str],
        typer.Option(
            "--to",
            help="the new release: package==version (wheel cache, pip download on a miss) or a .whl path; "
            "repeatable, one per upstream package",
        ),
    ],
    apply_: Annotated[
        bool, typer.Option("--apply", help="if every patch applies, write generated/ and the pins in pyproject.toml")
    ] = False,
    report: Annotated[
        Path | None,
        typer.Option("--report", help="also write the Markdown report to this file (e.g. docs/upgrades/<name>.md)"),
    ] = None,
    migrate_: Annotated[
        bool,
        typer.Option(
            "--migrate",
            help="propose spec edits for the patches that do not apply (review them in specs.diff of the review "
            "directory; rules in docs/upgrading-transformers.md)",
        ),
    ] = False,
    apply_specs: Annotated[
        bool, typer.Option("--apply-specs", help="with --migrate: write the proposed spec edits to specs/")
    ] = False,
    verify_: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="regenerate the models (migrated with --migrate) in a scratch copy of the project and run their "
            "parity suites there in a scratch venv holding the release; adds the proof column to the report",
        ),
    ] = False,
    verify_models: Annotated[
        list[str] | None,
        typer.Option("--verify-model", help="with --verify: prove only this model (spec name); repeatable"),
    ] = None,
    with_specs: Annotated[
        Path | None,
        typer.Option(
            "--with-specs",
            help="read specs/ with each DIR/<name>.toml in place of its spec (a reviewed migration, e.g. "
            "docs/upgrades/transformers-5.23.0/specs); only anchors, scopes and vars may differ; specs/ is not "
            "written (with --migrate --apply-specs: the replaced files and the proposed edits are)",
        ),
    ] = None,
    root: RootOption = None,
) -> None:
    """Regenerate every spec against a release read from its wheel (never installed) and report each patch:
    applied / anchor moved / scope missing / conflict ... Exit 0 when every patch applies, 1 otherwise."""
    if apply_specs and not migrate_:
        raise PatchgenError("--apply-specs writes what --migrate proposes: pass --migrate too")
    if with_specs is not None and apply_:
        raise PatchgenError(
            "--apply writes generated/ from specs/: apply the --with-specs files first (--apply-specs)"
        )
    config = open_project(root)
    if with_specs is None:
        _upgrade(config, to, apply_, report, migrate_, apply_specs, verify_, verify_models, None)
        return
    from patchgen.upgrade_review import with_specs as overlay

    run_config, replaced = overlay(config, with_specs.resolve())
    try:
        run = (config, replaced, with_specs.as_posix())
        _upgrade(run_config, to, apply_, report, migrate_, apply_specs, verify_, verify_models, run)
    finally:
        shutil.rmtree(run_config.specs_dir, ignore_errors=True)


def _upgrade(
    config: ProjectConfig,
    to: list[str],
    apply_: bool,
    report: Path | None,
    migrate_: bool,
    apply_specs: bool,
    verify_: bool,
    verify_models: list[str] | None,
    replaced: tuple[ProjectConfig, dict[Path, str], str] | None,
) -> None:
    """`upgrade`, with `config` reading specs/ or its `--with-specs` copy (then `replaced`: the project's config,
    the replaced texts by specs/ path and the folder as given)."""
    from patchgen.report import console, generated_diffs, markdown, write_report
    from patchgen.upgrade import analyze, apply, baseline_source
    from patchgen.upgrade_review import write_review

    specs = load_specs(config, None)
    unknown = sorted(set(verify_models or []) - {s.name for s in specs})
    if unknown:
        known = ", ".join(config.models())
        raise PatchgenError(f"--verify-model {', '.join(unknown)}: no spec of that name; available: {known}")
    cache = wheel_cache(config.root)
    started = time.perf_counter()
    obtained = obtain_all(to, config.pins, cache, "--to", config.wheel_sha256)
    wheels = [wheel for wheel, _ in obtained]
    baseline, fetched = baseline_source(config, {w.package for w in wheels}, cache)
    got_wheels = time.perf_counter()
    result = analyze(config, specs, wheels, baseline)
    analyzed, section, migration = time.perf_counter(), "", None
    if migrate_:
        from patchgen.migrate import markdown as migration_markdown
        from patchgen.migrate import migrate

        migration = migrate(config, result, baseline, WheelSource(wheels))
        if replaced is not None:  # restated against specs/: the reviewed files with the rules' edits on top
            from patchgen.migrate import onto_specs

            migration = onto_specs(migration, replaced[0], config.specs_dir, replaced[1])
        section = "\n" + migration_markdown(migration, ", ".join(w.pin for w in wheels))
    flag = ""
    if replaced is not None:
        flag = f" --with-specs {replaced[2]}"
        names = ", ".join(p.name for p in sorted(replaced[1]))
        section += (
            f"\n## Specs (`--with-specs`)\n\nThis run read specs/ with {names} replaced by those of `{replaced[2]}`.\n"
        )
    verification, migrated = None, time.perf_counter()
    if verify_ or verify_models:
        from patchgen import verify

        texts = migration.texts if migration else (replaced[1] if replaced else None)
        edits = {p.relative_to(config.root).as_posix(): t for p, t in texts.items()} if texts else None
        verification = verify.verify(config.root, wheels, baseline, cache, verify_models, edits)
        command = result.command + flag + (" --migrate" if migrate_ else "") + " --verify"
        command += "".join(f" --verify-model {m}" for m in verify_models or [])
        section += "\n" + verify.markdown(verification, command)
    text = markdown(result) + section
    review = write_review(config, result, text, {"specs.diff": migration.diff} if migration else None)
    if report is not None:
        write_report(report.resolve(), markdown(result, diffs=report.stem) + section, generated_diffs(result))
    done = time.perf_counter()
    typer.echo(console(result))
    typer.echo(
        f"review: {review.relative_to(config.root)}/ (REPORT.md, new generated files and their upstream diffs)"
        + (f"; report also written to {report}" if report is not None else "")
    )
    how = [
        f"{w.path.name} {'downloaded' if new else 'cached' if w.path.parent == cache else 'given'}"
        for w, new in obtained
    ] + [f"{name} downloaded (pinned baseline)" for name in fetched]
    typer.echo(
        f"wheels in {got_wheels - started:.1f} s ({'; '.join(how)}); regenerated and compared in "
        f"{analyzed - got_wheels:.1f} s" + (f"; migrated in {migrated - analyzed:.1f} s" if migration else "")
    )
    if migration is not None:
        (before, total), (after, _) = migration.before, migration.after
        typer.echo(
            f"migration: {before} of {total} patches apply with the pinned specs, {after} with the migrated ones; "
            f"edits in {review.relative_to(config.root)}/specs.diff"
        )
        if apply_specs:
            from patchgen.migrate import apply_specs as write_specs

            for path in write_specs(migration):
                typer.echo(f"  wrote  {path.relative_to(config.root)}")
            typer.echo(f"rerun `{result.command}` to review the release with the migrated specs")
    if verification is not None:
        typer.echo(verify.console(verification))
        typer.echo(f"verified in {done - migrated:.1f} s (scratch venv and tree, regeneration, pytest)")
    if apply_:
        if not result.ok:
            typer.echo(
                "--apply refused: not every patch applies; nothing under generated/ or in pyproject.toml changed",
                err=True,
            )
            raise typer.Exit(1)
        changed = apply(config, result)
        for path in changed:
            typer.echo(f"  wrote  {path.relative_to(config.root)}")
        typer.echo(
            f"applied {', '.join(result.moves())}. Install it (pip install -e '.[runtime]'), or pass "
            f"`--from {' --from '.join(w.pin for w in wheels)}` to regen/check until you do"
        )
    if not result.ok or (verification is not None and not verification.proven):
        raise typer.Exit(1)


def main() -> None:
    """Run the CLI. Every outcome is an exit code: 0 ok, 1 drift (or patches that do not apply), 2 anything else,
    with one message on stderr and never a traceback (unless PATCHGEN_DEBUG=1 asks for it)."""
    try:
        code = app(standalone_mode=False)  # without standalone mode click *returns* a command's typer.Exit code
    except PatchgenError as exc:
        _fail(str(exc))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:
        if any(cls.__name__ == "ClickException" for cls in type(exc).__mro__):  # usage errors (typer's own click)
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `patchgen`: the help is the answer
                exc.show()
                sys.exit(2)
            _fail(usage_line(exc))
        if os.environ.get("PATCHGEN_DEBUG"):
            traceback.print_exc()
            sys.exit(2)
        if isinstance(exc, OSError) and exc.strerror:  # a file the user can fix: missing, unreadable, unwritable
            names = " -> ".join(str(n) for n in (exc.filename, exc.filename2) if n is not None)
            _fail(f"{names}: {exc.strerror}" if names else exc.strerror)
        text = str(exc).strip().splitlines()
        _fail(
            f"internal error: {type(exc).__name__}{': ' + text[0] if text else ''} "
            f"(a bug in patchgen; rerun with PATCHGEN_DEBUG=1 to see the traceback)"
        )
    sys.exit(code if isinstance(code, int) else 0)


def usage_line(exc: Exception) -> str:
    """click's usage error (usage, hint and message over several lines) as one line: the command, what is wrong,
    the commands there are when the command is unknown, and where help is."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "patchgen"
    message = " ".join(exc.format_message().split()).rstrip(".")
    listed = ""
    if ctx is not None and hasattr(ctx.command, "list_commands") and message.startswith("No such command"):
        listed = f"commands: {', '.join(sorted(ctx.command.list_commands(ctx)))}; "
    return f"{where}: {message[:1].lower()}{message[1:]} ({listed}see `{where} --help`)"


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
