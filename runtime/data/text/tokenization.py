"""Samples -> token ids and labels, and a small locally trained tokenizer for tests and demos.

Labels are unshifted (``labels == input_ids`` where trained, ``IGNORE_INDEX`` elsewhere); the loss shifts them.

Chat masking renders the conversation prefix by prefix with the tokenizer's own chat template: for each assistant
turn ``i``, ``render(messages[:i], add_generation_prompt=True)`` ends where the reply starts and
``render(messages[:i+1])`` ends where it stops, giving a character span of the full rendering. Tokens are then mapped
to characters through the fast tokenizer's offset mapping, and a token is a target when it overlaps a reply span.
We chose this over ``return_assistant_tokens_mask`` because that needs ``{% generation %}`` markers, which most
published chat templates lack, whereas prefix rendering works with any template whose renderings of successive
prefixes extend one another (checked; a clear ValueError otherwise). Working in characters rather than comparing
token counts of the prefixes stays correct when BPE merges characters across a turn boundary. (A conversation that
opens with an assistant message has no prefix to render, since templates refuse empty conversations; there the reply
starts at the last occurrence of its text in the one-message rendering.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data.samples import ChatSample, Sample, TextSample
from runtime.data.sp_batch import IGNORE_INDEX


@dataclass(frozen=True)
class TokenizedSample:
    """One sample's token ids and unshifted labels (``IGNORE_INDEX`` where nothing is learned)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"input_ids and labels differ in length: {len(self.input_ids)} != {len(self.labels)}")
        if not self.input_ids:
            raise ValueError("a tokenized sample needs at least one token")

    def __len__(self) -> int:
        return len(self.input_ids)


def load_tokenizer(path: str | Path):
    """A HF tokenizer from a local directory (never the Hub: a path that does not exist is an error here)."""
    import transformers

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def tokenize_text(text: str, tokenizer) -> TokenizedSample:
    """Tokenize with the tokenizer's own special-token convention (e.g. a BOS) and end with EOS; all tokens trained."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; text samples need one to mark where a document ends")
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)
    return TokenizedSample(tuple(ids), tuple(ids))


def _content_text(content: Any) -> str:
    """A message's text: string content as is, or the text parts of a list of ``{"type": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def assistant_spans(
    tokenizer, messages: Sequence[dict[str, Any]], expand: Callable[[str], str] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering of a conversation and the character span ``[start, end)`` of every assistant reply.

    A span runs from the end of the generation prompt to the end of the turn including its end-of-turn marker;
    trailing whitespace the template adds after the marker is left out (it is formatting, not something to learn).
    ``tokenizer`` is anything with a HF ``apply_chat_template`` (a tokenizer or a multimodal processor). ``expand``
    rewrites every rendering before spans are measured (a VLM's image placeholders -> their expanded tokens): it must
    map each prefix of the conversation to a prefix of the expanded whole, as in-order placeholder expansion does.
    """
    messages = list(messages)

    def render(upto: int, add_generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return text if expand is None else expand(text)

    full = render(len(messages), add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = render(i + 1, add_generation_prompt=False)
        reply = _content_text(message["content"])
        if i:
            before = render(i, add_generation_prompt=True)
            start = len(before) if through.startswith(before) else -1
        else:
            # Templates cannot render an empty conversation: find the opening reply as the last match of its text.
            start = through.rfind(reply) if reply else -1
        if start < 0 or not full.startswith(through):
            raise ValueError(
                f"the chat template does not render conversation prefixes as prefixes of each other (assistant "
                f"message {i}), so the assistant tokens cannot be located; use a template without that behaviour"
            )
        end = len(through.rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def labels_from_spans(
    input_ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """Unshifted labels: a token's own id where its characters overlap a span, ``IGNORE_INDEX`` elsewhere."""
    labels = [IGNORE_INDEX] * len(input_ids)
    for k, (start, end) in enumerate(offsets):
        end = max(end, start + 1)  # offset trimming can leave a whitespace token empty: it still sits at `start`
        if any(start < s_end and s_start < end for s_start, s_end in spans):
            labels[k] = input_ids[k]
    return labels


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of a rendered conversation (no special tokens added: the template did)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chat label masking needs a fast tokenizer (it maps tokens to characters by offsets)")
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]]


def tokenize_chat(messages: Sequence[dict[str, str]], tokenizer) -> TokenizedSample:
    """Tokenize a conversation with the chat template; only tokens of assistant replies carry labels."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chat label masking needs a fast tokenizer (it maps tokens to characters by offsets)")
    full, spans = assistant_spans(tokenizer, messages)
    ids, offsets = encode_with_offsets(tokenizer, full)
    return TokenizedSample(tuple(ids), tuple(labels_from_spans(ids, offsets, spans)))


def tokenize_sample(sample: Sample, tokenizer) -> TokenizedSample:
    """Dispatch on the sample type (see ``tokenize_text`` and ``tokenize_chat``).

    A chat whose content is a list of text parts is its joined text; one with images or videos is refused (it needs
    a processor: ``runtime.data.vision.tokenization.tokenize_multimodal``).
    """
    if isinstance(sample, TextSample):
        return tokenize_text(sample.text, tokenizer)
    if isinstance(sample, ChatSample):
        if sample.is_multimodal:
            raise ValueError(
                "this chat sample holds images or videos: tokenize it with a VLM processor "
                "(runtime.data.vision.tokenization.tokenize_multimodal), not a text tokenizer"
            )
        return tokenize_chat([{"role": m.role, "content": m.text} for m in sample.messages], tokenizer)
    raise TypeError(f"not a sample: {type(sample).__name__}")


def tokenize_samples(samples: Iterable[Sample], tokenizer) -> list[TokenizedSample]:
    """Tokenize every sample, in order."""
    return [tokenize_sample(s, tokenizer) for s in samples]


PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|startoftext|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML-style. The {% generation %} markers are not used by tokenize_chat; they let the tests cross-check our
# prefix-rendering mask against transformers' own `return_assistant_tokens_mask`.
TEST_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_test_tokenizer(
    directory: str | Path,
    corpus_text: str,
    vocab_size: int = 512,
    extra_special_tokens: Sequence[str] = (),
    chat_template: str = TEST_CHAT_TEMPLATE,
) -> Path:
    """Train a byte-level BPE on ``corpus_text`` and save it as a HF tokenizer in ``directory``; return the path.

    Byte-level means any text round-trips exactly, so tests and demos get a real tokenizer (special tokens, chat
    template, offsets) without a download. Training on a few hundred KB takes well under a second.
    ``extra_special_tokens`` (e.g. a VLM's vision markers) are trained in as whole special tokens after the chat ones.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, *extra_special_tokens]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus_text.split("\n\n"), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=specials[3:],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory
