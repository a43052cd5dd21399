"""User errors: bad spec, template, anchor or upstream version. The CLI exits 2 on them (and 1 on drift)."""

from __future__ import annotations


class PatchgenError(Exception):
    """A user error: bad spec, bad template, anchor miss, wrong upstream version. Exit code 2."""

    exit_code = 2
