"""`patchgen draft <model_type>` and `patchgen draft --check <name>`: write (or diff) the spec drafted from the pinned
upstream module. A draft is generated in memory before it is written, so a written draft always regenerates.

Light at import (cli.py imports it): libcst and the engine load when the command runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.upstream import PinnedSource


def draft(
    name: Annotated[
        str,
        typer.Argument(
            help="a transformers model type (e.g. llama), a diffusers transformer class (FluxTransformer2DModel), "
            "or with --check a spec name"
        ),
    ],
    check: Annotated[
        bool, typer.Option("--check", help="re-draft and print the diff against specs/<name>.toml (exit 1 if any)")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="replace an existing specs/<name>.toml")] = False,
    stdout: Annotated[
        bool, typer.Option("--stdout", help="print the draft (generated in memory first) instead of writing it")
    ] = False,
    root: Annotated[Path | None, typer.Option("--root", help="project root (default: found from the cwd)")] = None,
) -> None:
    """Draft specs/<name>.toml from the pinned upstream module: each patch a structure recognised there (file:line in
    its comment), the [model] table and a tiny config; what is not recognised goes to [model.unsupported]."""
    from patchgen.draft.loading import load_drafted
    from patchgen.draft.pipeline import check_draft, draft_spec, prove
    from patchgen.files import write_text_atomic

    config = load_config(root)
    source = PinnedSource(config.pins)
    if check:
        raise typer.Exit(check_draft(config, name, source))
    started = time.perf_counter()
    drafted = draft_spec(name, source, config.pins, project=config)
    path = config.spec_path(drafted.target.name)
    rel = path.relative_to(config.root) if path.is_relative_to(config.root) else path
    if path.exists() and not (force or stdout):
        raise PatchgenError(
            f"{rel} exists: draft never overwrites a spec silently; see what differs with `patchgen draft --check "
            f"{drafted.target.name}`, or replace it with `patchgen draft --force {name}`"
        )
    prove(config, load_drafted(config, drafted.target.name, drafted.text), source)
    unsupported = drafted.found.unsupported
    stated = f"; [model.unsupported]: {', '.join(unsupported)}" if unsupported else ""
    found = f"{len(drafted.found.patches)} patches{stated} ({time.perf_counter() - started:.1f} s)"
    if stdout:  # the spec alone on stdout (a pipe gets TOML), what was found on stderr
        typer.echo(drafted.text, nl=False)
        typer.echo(f"drafted {rel} (not written): {found}", err=True)
        return
    write_text_atomic(path, drafted.text)
    typer.echo(f"wrote {rel}: {found}; next: `patchgen regen {drafted.target.name}`, review the .diff, run the suites")
