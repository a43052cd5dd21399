"""Shared fixtures of the data tests: one small tokenizer trained on the shipped corpus per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.data.text.corpus import corpus_path
from runtime.data.text.tokenization import build_test_tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_tokenizer(tmp_path_factory.mktemp("tokenizer"), corpus_path().read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)
