"""`patchgen --help` and each command's help as a user reads them: no type label on a flag that takes no value (typer's
rich renderer prints `--help <bool>`), and every bracketed word of a docstring kept (rich markup reads `[model.data]`
as a style tag and drops it). Through typer's CliRunner: the rendering is the code under test, no interpreter start."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from patchgen.cli import app

WIDE = {"COLUMNS": "200", "TERM": "dumb"}  # one line per entry, so a phrase is never split by wrapping


def help_text(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", [(), ("list",), ("regen",), ("check",), ("upgrade",)])
def test_flags_show_no_value_type(command: tuple[str, ...]) -> None:
    text = help_text(*command)
    assert "--help" in text
    assert "<bool>" not in text, text


def test_bracketed_words_survive_in_list_help() -> None:
    assert "where its [model.data] names them" in " ".join(help_text("list").split())


def test_options_still_show_their_values() -> None:
    text = " ".join(help_text("regen").split())
    assert "--root <path> project root" in text
    assert "--dry-run report what would change" in text
