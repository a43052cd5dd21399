"""Hostile command lines and releases (issue 25, item 4). Rule: a bad command, option or argument, a release that
cannot be downloaded and a release without a recorded hash each end in exit 2 with exactly one line on stderr
(`error: ...`, naming what was wrong and what to do), nothing on stdout, and nothing written or downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from patchgen.wheels import wheel_cache
from tests.engine.helpers import VERSION, make_project, run_cli, spec_toml

PATCHGEN = Path(sys.executable).parent / "patchgen"


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_project(tmp_path / "proj", {"toy": spec_toml()}).root


def one_line(code: int, out: str, err: str) -> str:
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
    return err


def test_an_unknown_command_is_one_line_listing_the_commands(root) -> None:
    """The console script itself: typer's usage box becomes one line."""
    result = subprocess.run(
        [str(PATCHGEN), "regenerate", "--root", str(root)], capture_output=True, text=True, timeout=60
    )
    err = one_line(result.returncode, result.stdout, result.stderr)
    assert "no such command 'regenerate'" in err
    assert "commands: check, diff, draft, explain, list, regen, upgrade" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("regen", "--bogus"), "no such option: --bogus"),
        (("explain",), "missing argument 'model'"),
        (("list", "extra"), "got unexpected extra argument"),
        (("upgrade",), "missing option '--to'"),
        (("check", "--full=3"), "--full"),
    ],
)
def test_a_usage_error_is_one_line(root, capsys, args, message) -> None:
    before = tree(root)
    err = one_line(*run_cli(root, capsys, *args))
    assert message in err.lower() and "--help" in err, err
    assert tree(root) == before


def test_a_release_without_a_recorded_hash_is_refused_before_any_download(root, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # should pip run after all, it fails at once, offline
    err = one_line(*run_cli(root, capsys, "upgrade", "--to", "fixturepkg==9.9.9"))
    assert "no sha256 recorded for fixturepkg==9.9.9" in err and "[tool.patchgen.wheel_sha256]" in err, err
    assert not wheel_cache(root).exists()  # nothing was downloaded, not even the cache folder made


def test_a_release_that_cannot_be_downloaded_is_one_line(root, capsys, monkeypatch) -> None:
    """pip really runs (with no index it cannot find the release) and its multi-line output becomes one line."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    err = one_line(*run_cli(root, capsys, "regen", "--all", "--from", f"fixturepkg=={VERSION}"))
    assert f"cannot download fixturepkg=={VERSION}" in err and "put the wheel into" in err, err
    assert not list(wheel_cache(root).glob("*.whl"))
