from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.data.samples import (
    ChatMessage,
    ChatSample,
    TextSample,
    read_jsonl,
    read_samples_located,
    read_text_documents,
    split_documents,
)
from runtime.data.text.corpus import corpus_path


def read_samples(path: Path, target_chars: int = 2000) -> list:
    """The samples of a data file without their locations (what the trainer reads, ``read_samples_located``)."""
    return [located.sample for located in read_samples_located(path, target_chars)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_text_and_chat_lines(tmp_path: Path) -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ],
        "id": 7,
    }
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "Once upon a time."}), "", json.dumps(chat)])
    assert read_jsonl(path) == [
        TextSample("Once upon a time."),
        ChatSample(
            (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello."))
        ),
    ]
    assert read_samples(path) == read_jsonl(path)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "expected one JSON object per line, invalid JSON"),
        ("[1, 2]", 'expected an object {"text": ...} or {"messages": [...]}, got list'),
        ('{"txt": "a"}', "expected exactly one of the keys 'text' or 'messages', found neither"),
        ('{"text": "a", "messages": []}', "found both"),
        ('{"text": 3}', "'text' must be a non-empty string"),
        ('{"text": ""}', "'text' must be a non-empty string"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": ["hi"]}', "messages[0] must be an object with 'role' and 'content', got str"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role must be one of system, user, assistant"),
        ('{"messages": [{"role": "user", "content": 1}]}', "messages[0].content must be a string, got int"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "needs at least one assistant message"),
    ],
)
def test_bad_line_names_file_line_and_expectation(tmp_path: Path, line: str, expected: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', "", line])
    with pytest.raises(ValueError) as info:
        read_jsonl(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert expected in str(info.value)


def test_split_documents_cuts_between_paragraphs_near_the_target() -> None:
    paragraphs = [f"Paragraph {i} " + "word " * (i % 7 + 3) for i in range(40)]
    text = "\n\n".join(paragraphs) + "\n\n\n" + "x" * 500
    documents = split_documents(text, target_chars=200)
    assert "\n\n".join(documents) == "\n\n".join(p.strip() for p in [*paragraphs, "x" * 500])
    assert all(len(d) <= 200 for d in documents[:-1])
    assert documents[-1] == "x" * 500  # longer than the target: kept whole, never cut mid-paragraph
    with pytest.raises(ValueError, match="target_chars"):
        split_documents(text, 0)


def test_shipped_corpus_is_sizeable_english_text() -> None:
    path = corpus_path()
    size = path.stat().st_size
    assert 150_000 <= size < 500_000
    documents = read_text_documents(path, target_chars=1500)
    assert len(documents) > 100
    assert read_samples(path, target_chars=1500) == documents
    text = path.read_text(encoding="utf-8")
    assert "In the beginning God created the heaven and the earth." in text
    assert (Path(path).parent / "README.md").is_file()
