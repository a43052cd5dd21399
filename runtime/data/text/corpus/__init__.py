"""A small public-domain English corpus shipped with the runtime, so demos and tests train on real text offline."""

from __future__ import annotations

from pathlib import Path

CORPUS_FILE = "corpus.txt"


def corpus_path() -> Path:
    """The combined corpus: plain UTF-8 text, works separated by two blank lines, paragraphs by one."""
    return Path(__file__).with_name(CORPUS_FILE)
