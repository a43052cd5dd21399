"""`patchgen` command line. Exit codes: 0 ok, 1 drift, 2 user error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.generate import explain as explain_spec
from patchgen.generate import generate
from patchgen.project import check as check_project
from patchgen.project import load_specs
from patchgen.project import regen as regen_project
from patchgen.upstream import PinnedSource

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Generate reviewable training variants of upstream modeling code from declarative specs.")
RootOption = Annotated[Path | None, typer.Option("--root", help="project root (default: found from the cwd)")]


@app.command()
def regen(models: Annotated[list[str] | None, typer.Argument(help="models (spec names) to regenerate")] = None,
          all_: Annotated[bool, typer.Option("--all", help="regenerate every spec")] = False,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="report what would change, write nothing")] = False,
          root: RootOption = None) -> None:
    """Regenerate generated/ files (and their .diff) from specs, templates and the pinned upstream."""
    if bool(models) == all_:
        raise PatchgenError("name the models to regenerate, or pass --all (not both)")
    config = load_config(root)
    changes = regen_project(config, load_specs(config, None if all_ else models), dry_run=dry_run)
    verb = "would write" if dry_run else "wrote"
    for change in changes:
        rel = change.path.relative_to(config.root)
        typer.echo(f"{change.status:>9}  {rel}" + (f"  ({verb})" if change.status != "unchanged" else ""))


@app.command()
def check(models: Annotated[list[str] | None, typer.Argument(help="models to check (default: all)")] = None,
          full: Annotated[bool, typer.Option("--full", help="regenerate even when hashes prove freshness")] = False,
          root: RootOption = None) -> None:
    """Fail (exit 1) when a generated file differs from what spec + templates + pinned upstream produce."""
    config = load_config(root)
    specs = load_specs(config, models)
    drifts = check_project(config, specs, full=full)
    for drift in drifts:
        typer.echo(f"DRIFT {drift.path.relative_to(config.root)}: {drift.reason}", err=True)
        if drift.diff:
            typer.echo(drift.diff, err=True)
    if drifts:
        raise typer.Exit(1)
    typer.echo(f"ok: {len(specs)} spec(s) match generated/")


@app.command("list")
def list_models(root: RootOption = None) -> None:
    """Specs in this project: model, upstream module, output, patch count."""
    config = load_config(root)
    for spec in load_specs(config, None):
        typer.echo(f"{spec.name:<16} {spec.module:<56} {spec.output}  ({len(spec.patches)} patches)")


@app.command()
def diff(model: str, root: RootOption = None) -> None:
    """Print the unified diff from upstream to the generated file, as regenerated now."""
    config = load_config(root)
    [spec] = load_specs(config, [model])
    typer.echo(generate(spec, PinnedSource(config.pins), config).diff, nl=False)


@app.command()
def explain(model: str, root: RootOption = None) -> None:
    """Every patch: template and op, scope, the upstream line of its anchor, why, and the rendered code."""
    config = load_config(root)
    [spec] = load_specs(config, [model])
    upstream, patches = explain_spec(spec, PinnedSource(config.pins))
    typer.echo(f"{spec.name}: {spec.path.name} -> {spec.output} from {upstream.pin} {upstream.relpath}")
    for p in patches:
        typer.echo(f"\n#{p.index} {p.template} (op {p.op}) @ {p.scope}, upstream line {p.upstream_line}")
        typer.echo(f"  why: {p.why}")
        if p.anchor:
            typer.echo(f"  anchor: {p.anchor}")
        typer.echo("  rendered:")
        typer.echo("\n".join(f"    | {line}" for line in p.rendered.splitlines()))


def main() -> None:
    try:
        code = app(standalone_mode=False)  # without standalone mode click *returns* a command's typer.Exit code
    except PatchgenError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:  # usage errors; typer may vendor its own click, so match the class by name
        if any(cls.__name__ == "ClickException" for cls in type(exc).__mro__):
            exc.show()
            sys.exit(2)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
