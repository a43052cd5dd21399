"""Hostile launcher options of the run commands (``python -m runtime.train|runtime.rl [LAUNCHER OPTIONS] cfg.yaml``).

Rules checked here: torchrun reads its options with argparse, which takes any unambiguous prefix of a long option;
the command reads them the same way (checked against argparse itself over torchrun's option list), so an
abbreviation of an option that names what to run (``--run-pat x``, ``--no-pyt``, ``--mod``, also ``=``-joined) is
refused like the option itself, and a number of processes or nodes torchrun cannot start (``--nproc-per-node 0``) is
one line: exit 2, no rank started.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest
import yaml

from runtime.cli import UsageError, parse_command_line
from runtime.launcher_options import TORCHRUN_FLAGS, TORCHRUN_OPTIONS, LauncherOptionError, resolve

REFUSED = ("module", "no_python", "run_path")


@pytest.fixture(scope="module")
def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def test_option_list_is_torchruns(torchrun_parser: argparse.ArgumentParser) -> None:
    options = {o: a.dest for a in torchrun_parser._actions for o in a.option_strings}
    flags = {a.dest for a in torchrun_parser._actions if a.option_strings and a.nargs == 0}
    assert TORCHRUN_OPTIONS == options
    assert TORCHRUN_FLAGS == flags


class _Refused(Exception):
    pass


def _lookalike(torchrun_parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """torchrun's option strings in an argparse parser of their own (no types or choices: only the matching of a
    token to an option is compared), every error an exception."""
    parser = argparse.ArgumentParser(add_help=False)
    for action in torchrun_parser._actions:
        if action.option_strings:
            kind = "store_true" if action.nargs == 0 else "store"
            parser.add_argument(*action.option_strings, dest=action.dest, action=kind, default=None)

    def error(message: str) -> None:
        raise _Refused(message)

    parser.error = error
    return parser


def _argparse_reading(parser: argparse.ArgumentParser, token: str) -> tuple[str, str | None] | None:
    """(dest, the value read from the token itself) as argparse reads ``token VALUE``; None: refused or unknown."""
    try:
        args, extra = parser.parse_known_args([token, "VALUE"])
    except _Refused:
        return None
    if token in extra:
        return None
    (dest,) = [d for d, v in vars(args).items() if v is not None]
    value = getattr(args, dest)
    return dest, (None if value in (True, "VALUE") else value)


def _tokens() -> list[str]:
    out = []
    for option in TORCHRUN_OPTIONS:
        start = 3 if option.startswith("--") else 2
        for end in range(start, len(option) + 1):
            out += [option[:end], option[:end] + "=x", option[:end] + "=", option[:end] + "7"]
    return out + ["--", "-", "-x", "-m=1", "-r=0", "-t3", "--nproc", "--nproc=2", "--rdzv", "--no", "--r", "--mo"]


def test_options_are_read_as_argparse_reads_them(torchrun_parser: argparse.ArgumentParser) -> None:
    parser = _lookalike(torchrun_parser)
    differ = []
    for token in _tokens():
        expected = _argparse_reading(parser, token)
        try:
            ours = resolve(token)
        except LauncherOptionError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(f"{token}: "), exc
            ours = None
        if ours != expected:
            differ.append((token, ours, expected))
    assert not differ, differ[:20]


def _abbreviations(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    """Every token argparse reads as the option ``dest`` (prefixes, ``=x`` forms)."""
    return [t for t in _tokens() if (_argparse_reading(parser, t) or ("",))[0] == dest]


@pytest.mark.parametrize("dest", REFUSED)
def test_abbreviations_of_refused_options_are_refused(torchrun_parser: argparse.ArgumentParser, dest: str) -> None:
    tokens = _abbreviations(_lookalike(torchrun_parser), dest)
    assert "--run-pat" in tokens or dest != "run_path"
    for token in tokens:
        with pytest.raises(UsageError) as err:
            parse_command_line([token, "x", "cfg.yaml"])
        assert "the command sets what the ranks run" in str(err.value) and "\n" not in str(err.value), token


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr("runtime.cli.launch", refuse)


def _main(module: str, argv: list[str]) -> tuple[int, list[str]]:
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue().strip().splitlines()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    from tests.train.common import run_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path)))
    return path


@pytest.mark.parametrize(
    "argv",
    [["--run-pat", "x"], ["--run-pat=x"], ["--run_pa", "x"], ["--no-pyt"], ["--no_p"], ["--mod"], ["--modul"]],
    ids=lambda a: " ".join(a),
)
def test_run_commands_refuse_abbreviated_run_options(config: Path, no_launch, argv: list[str]) -> None:
    for module in ("runtime.train", "runtime.rl"):
        code, lines = _main(module, [*argv, str(config)])
        assert code == 2 and len(lines) == 1 and "the command sets what the ranks run" in lines[0], (module, lines)
        assert lines[0].startswith(f"error: {argv[0]}: "), lines


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0: expected a number of processes per node of at least 1"),
        (["--nproc-per-node=0"], "--nproc-per-node 0: expected"),
        (["--nproc_per_node", "-1"], "--nproc-per-node -1: expected"),
        (["--nproc-per", "0"], "--nproc-per-node 0: expected"),
        (["--nproc-per-node", "2 "], "--nproc-per-node 2 : expected"),
        (["--nnodes", "0"], "--nnodes 0: expected a number of nodes of at least 1"),
        (["--nnodes", "2:1"], "--nnodes 2:1: expected"),
        (["--nnodes=1:x"], "--nnodes 1:x: expected"),
        (["--nproc", "2"], "--nproc: ambiguous launcher option"),
        (["--standalone=1"], "--standalone=1: --standalone takes no value"),
        (["--bogus", "1"], "--bogus: not a launcher option"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else "",
)
def test_launcher_values_torchrun_cannot_start_are_one_line(config: Path, no_launch, argv, words) -> None:
    code, lines = _main("runtime.train", [*argv, str(config)])
    assert code == 2 and len(lines) == 1 and words in lines[0], lines


def test_standalone_abbreviation_is_a_flag_not_swallowing_the_config(config: Path, monkeypatch) -> None:
    """``--standal cfg.yaml``: argparse reads ``--standalone`` (no value), so the config path is still the config."""
    seen = {}
    monkeypatch.setattr("runtime.cli.launch", lambda module, launcher, args: seen.update(launcher=launcher) or 0)
    code, lines = _main("runtime.train", ["--standal", "--nproc-per", "1", str(config)])
    assert code == 0 and seen["launcher"] == ["--standal", "--nproc-per", "1"], (lines, seen)


def test_help_by_abbreviation(capsys) -> None:
    assert parse_command_line(["--he"]).help


@pytest.mark.parametrize("launcher", [["--run-pat", "x"], ["--no-pyt"], ["--nproc-per-node", "1", "--no_py"]])
def test_launch_itself_refuses_what_names_the_script(launcher: list[str]) -> None:
    """Behind parse_command_line: torchrun's own parser's reading is checked before any rank starts."""
    from runtime.cli import launch

    with pytest.raises(UsageError, match="the command sets what the ranks run"):
        launch("runtime.train", launcher, ["cfg.yaml"])
