"""Reading a JSONL file record by record, for every data file of the runtime (training samples, DiT media lines, RL
prompts and preference pairs): each line's JSON value goes to a parser, and any error names ``file:line``.

Limits: a line holds at most ``MAX_LINE_BYTES`` bytes (read with that cap, so a line of gigabytes is refused after
reading its first 16 MiB, not loaded) and nests at most ``MAX_JSON_DEPTH`` levels of objects and lists (a sample
needs six; deeper nesting is refused instead of exhausting Python's recursion).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from runtime.data.errors import LineError

T = TypeVar("T")

MAX_LINE_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64


def _too_deep(value: Any) -> bool:
    """Whether objects and lists nest more than ``MAX_JSON_DEPTH`` levels in a decoded JSON value."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            if level > MAX_JSON_DEPTH:
                return True
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def _decode_line(line: bytes, where: str) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
    too_deep = ValueError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep (the limit per line)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: expected one JSON object per line, invalid JSON: {e}") from None
    except RecursionError:  # deeper than Python's recursion limit, which is above MAX_JSON_DEPTH
        raise too_deep from None
    if _too_deep(record):
        raise too_deep
    return record


def read_records(path: str | Path, parse: Callable[[Any, str], T]) -> list[T]:
    """``parse(record, "file:line")`` for every non-blank line of a JSONL file, in order. Invalid JSON, non-UTF-8
    text, a line over the limits and a ``LineError`` from ``parse`` become one ValueError naming the file and
    line."""
    path = Path(path)
    out: list[T] = []
    with path.open("rb") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(
                    f"{where}: a line of more than {MAX_LINE_BYTES} bytes (16 MiB, the limit per line); split the "
                    f"sample or keep large content in files"
                )
            if not line.strip():
                continue
            try:
                out.append(parse(_decode_line(line, where), where))
            except LineError as e:
                raise ValueError(f"{where}: {e}") from None
    return out
