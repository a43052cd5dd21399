"""The error a data-line parser raises: what was wrong with one line, re-raised by the reader with ``file:line``."""

from __future__ import annotations


class LineError(ValueError):
    """What was wrong with one parsed line; re-raised with the file and line number."""
