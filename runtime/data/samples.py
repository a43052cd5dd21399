"""Read training samples from disk: JSONL (plain text or chat) and plain ``.txt`` files split into documents.

Parsing is strict and fails on the first bad line with the file, the line number and what was expected, because a
silently skipped or misread line only shows up much later as a worse model.

A chat message's ``content`` is a string or, for vision-language models, a list of parts:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": "a.png"}`` or
``{"type": "video", "video": ["f0.png", "f1.png", ...], "fps": 2}`` (a video is its frames as image files; ``fps``
is optional; omni models: ``"audio": "track.wav"`` gives the video's audio track as a separate file) or, for omni
models, ``{"type": "audio", "audio": "clip.flac"}``. Media paths are relative to the JSONL file's directory and must
stay inside it (``runtime/data/media_paths.py``: ``data.media_dir`` names another root), and every file must exist
when the line is read: a missing image is a data error that should stop the run before training, not in the middle
of it.

Lines are read by ``runtime/data/records.py`` (its limits: bytes per line, nesting depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data.errors import LineError
from runtime.data.media_paths import MediaRoot
from runtime.data.records import read_records

DATA_SUFFIXES = (".jsonl", ".txt")  # JSON samples one a line, or plain text split into documents

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TextSample:
    """A plain document; every token is a training target."""

    text: str


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image file (an existing path, already resolved against the JSONL file's directory)."""

    path: Path


@dataclass(frozen=True)
class VideoPart:
    """A video as its frames, in order; ``fps`` is the rate they were sampled at, when known; ``audio`` its audio
    track as a separate file (omni models), when given."""

    frames: tuple[Path, ...]
    fps: float | None = None
    audio: Path | None = None


@dataclass(frozen=True)
class AudioPart:
    """An audio file (wav, flac, ...; an existing path, resolved like images)."""

    path: Path


ContentPart = TextPart | ImagePart | VideoPart | AudioPart
PART_TYPES = ("text", "image", "video", "audio")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | tuple[ContentPart, ...]

    @property
    def text(self) -> str:
        """The message's text: the string content, or its text parts joined (images and videos left out)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def has_media(self) -> bool:
        return not isinstance(self.content, str) and any(not isinstance(p, TextPart) for p in self.content)


@dataclass(frozen=True)
class ChatSample:
    """A conversation; only the assistant turns are training targets."""

    messages: tuple[ChatMessage, ...]

    @property
    def is_multimodal(self) -> bool:
        """Whether any message holds an image, a video or an audio (it then needs a processor, not a tokenizer)."""
        return any(m.has_media for m in self.messages)


Sample = TextSample | ChatSample


def _existing_file(value: Any, where: str, root: MediaRoot) -> Path:
    if not isinstance(value, str) or not value:
        raise LineError(f"{where} must be a non-empty file path string, got {value!r:.60}")
    path = root.resolve(value, where)
    if not path.is_file():
        raise LineError(f"{where}: file not found: {path}")
    return path


def _parse_part(item: Any, where: str, root: MediaRoot) -> ContentPart:
    if not isinstance(item, dict):
        raise LineError(f"{where} must be an object with a 'type', got {type(item).__name__}")
    kind = item.get("type")
    if kind not in PART_TYPES:
        raise LineError(f"{where}.type must be one of {', '.join(PART_TYPES)}, got {kind!r}")
    if kind == "text":
        if not isinstance(item.get("text"), str):
            raise LineError(f"{where}.text must be a string, got {type(item.get('text')).__name__}")
        return TextPart(item["text"])
    if kind == "image":
        return ImagePart(_existing_file(item.get("image"), f"{where}.image", root))
    if kind == "audio":
        return AudioPart(_existing_file(item.get("audio"), f"{where}.audio", root))
    frames = item.get("video")
    if not isinstance(frames, list) or not frames:
        raise LineError(f"{where}.video must be a non-empty list of frame image paths, got {frames!r:.60}")
    fps = item.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0):
        raise LineError(f"{where}.fps must be a positive number, got {fps!r}")
    paths = tuple(_existing_file(f, f"{where}.video[{k}]", root) for k, f in enumerate(frames))
    track = item.get("audio")
    audio = None if track is None else _existing_file(track, f"{where}.audio", root)
    return VideoPart(paths, None if fps is None else float(fps), audio)


def _parse_message(item: Any, index: int, root: MediaRoot) -> ChatMessage:
    if not isinstance(item, dict):
        raise LineError(f"messages[{index}] must be an object with 'role' and 'content', got {type(item).__name__}")
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise LineError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}")
    if isinstance(content, str):
        return ChatMessage(role, content)
    if not isinstance(content, list) or not content:
        raise LineError(
            f"messages[{index}].content must be a string, got {type(content).__name__} (a non-empty "
            f"list of {'/'.join(PART_TYPES)} parts is accepted too)"
        )
    where = f"messages[{index}].content"
    return ChatMessage(role, tuple(_parse_part(part, f"{where}[{k}]", root) for k, part in enumerate(content)))


def parse_sample(record: Any, base_dir: str | Path | MediaRoot | None = None) -> Sample:
    """One decoded JSON value -> a sample; ValueError saying what was expected otherwise.

    Keys other than ``text`` / ``messages`` (ids, metadata) are allowed and ignored. Media paths resolve against
    ``base_dir`` (the current directory when None) and must stay inside it (a ``MediaRoot`` says how).
    """
    root = base_dir if isinstance(base_dir, MediaRoot) else MediaRoot.at("." if base_dir is None else base_dir)
    if not isinstance(record, dict):
        raise LineError(f'expected an object {{"text": ...}} or {{"messages": [...]}}, got {type(record).__name__}')
    has_text, has_messages = "text" in record, "messages" in record
    if has_text == has_messages:
        found = "both" if has_text else "neither"
        raise LineError(f"expected exactly one of the keys 'text' or 'messages', found {found}")
    if has_text:
        text = record["text"]
        if not isinstance(text, str) or not text:
            raise LineError(f"'text' must be a non-empty string, got {text!r:.60}")
        return TextSample(text)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise LineError(f"'messages' must be a non-empty list of messages, got {messages!r:.60}")
    parsed = tuple(_parse_message(item, i, root) for i, item in enumerate(messages))
    if not any(m.role == "assistant" for m in parsed):
        raise LineError("a chat sample needs at least one assistant message (it would have no training targets)")
    return ChatSample(parsed)


@dataclass(frozen=True)
class LocatedSample:
    """A sample and where it came from (``file:line`` for JSONL, the file for a ``.txt`` document), for errors."""

    where: str
    sample: Sample


def read_jsonl_located(path: str | Path, media_dir: str | Path | None = None) -> list[LocatedSample]:
    """``read_jsonl`` with each sample's ``file:line``."""
    root = MediaRoot.of(path, media_dir)
    return read_records(path, lambda record, where: LocatedSample(where, parse_sample(record, root)))


def read_jsonl(path: str | Path, media_dir: str | Path | None = None) -> list[Sample]:
    """Every sample of a JSONL file, in file order; blank lines are skipped.

    A bad line raises ValueError naming the file, the line number and what was expected (for a missing image or
    frame, its path). Media paths resolve against the file's directory (``media_dir`` when given) and must stay
    inside it.
    """
    return [located.sample for located in read_jsonl_located(path, media_dir)]


def split_documents(text: str, target_chars: int = 2000) -> list[str]:
    """Split text into documents of about ``target_chars`` characters, cutting only between paragraphs.

    Paragraphs are separated by blank lines; consecutive paragraphs are joined (with a blank line) while the
    document stays within ``target_chars``. A paragraph longer than the target becomes a document on its own rather
    than being cut mid-sentence; the packer truncates anything longer than its token budget.
    """
    if target_chars < 1:
        raise ValueError(f"target_chars must be positive, got {target_chars}")
    paragraphs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
    documents: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in filter(None, paragraphs):
        added = len(paragraph) + (2 if current else 0)
        if current and size + added > target_chars:
            documents.append("\n\n".join(current))
            current, size, added = [], 0, len(paragraph)
        current.append(paragraph)
        size += added
    if current:
        documents.append("\n\n".join(current))
    return documents


def read_text_documents(path: str | Path, target_chars: int = 2000) -> list[TextSample]:
    """A ``.txt`` file as text samples of about ``target_chars`` characters each (see ``split_documents``)."""
    return [TextSample(d) for d in split_documents(Path(path).read_text(encoding="utf-8"), target_chars)]


def read_samples_located(
    path: str | Path, target_chars: int = 2000, media_dir: str | Path | None = None
) -> list[LocatedSample]:
    """Samples from a ``.jsonl`` file or a ``.txt`` plain-text file, chosen by the file suffix (any other suffix is a
    ValueError), each with where it came from (``file:line`` for JSONL, the file for text)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise ValueError(
            f"{path}: a data file must end in .jsonl (one JSON sample per line) or .txt (plain text, split into "
            f"documents), found {suffix or 'no suffix'!r}; rename it if it is one of these"
        )
    if suffix == ".jsonl":
        return read_jsonl_located(path, media_dir)
    try:
        documents = read_text_documents(path, target_chars)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return [LocatedSample(str(path), d) for d in documents]
