"""Errors with the exit codes the CLI promises: 2 for bad user input, 1 for drift."""

from __future__ import annotations


class PatchgenError(Exception):
    """A user error: bad spec, bad template, anchor miss, wrong upstream version. Exit code 2."""

    exit_code = 2


class DriftError(Exception):
    """Checked-in generated files differ from what spec + templates + upstream produce. Exit code 1."""

    exit_code = 1


def located(path: object, where: str, message: str) -> str:
    """One consistent shape for error text: `<file>: <where>: <message>`."""
    return f"{path}: {where}: {message}" if where else f"{path}: {message}"
