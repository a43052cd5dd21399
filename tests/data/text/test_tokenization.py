from __future__ import annotations

import pytest

from runtime.data.samples import ChatMessage, ChatSample, TextSample
from runtime.data.text.tokenization import IM_END, TokenizedSample, load_tokenizer, tokenize_chat, tokenize_sample

CONVERSATION = [
    {"role": "system", "content": "You answer in the style of a fable."},
    {"role": "user", "content": "Why should I work in summer?"},
    {"role": "assistant", "content": "The ant stores grain while the grasshopper sings."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Winter comes, and the idle go hungry."},
]


def test_test_tokenizer_is_small_and_round_trips_text(tokenizer) -> None:
    assert 256 <= len(tokenizer) <= 1024
    assert tokenizer.is_fast
    for token in (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token):
        assert token is not None
    text = "Shall I compare thee to a summer's day?\n\n  Odd   spacing, digits 1776, and non-ASCII: é, 日本."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    paragraph = "And God said, Let there be light: and there was light. And God saw the light, that it was good."
    assert len(tokenizer(paragraph)["input_ids"]) < len(paragraph) / 2  # the BPE learned merges from the corpus


def test_load_tokenizer_refuses_a_missing_directory(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")


def test_text_sample_ends_with_eos_and_trains_every_token(tokenizer) -> None:
    sample = tokenize_sample(TextSample("The Lion and the Mouse"), tokenizer)
    assert sample.input_ids[-1] == tokenizer.eos_token_id
    assert sample.labels == sample.input_ids
    assert tokenizer.decode(sample.input_ids[:-1]) == "The Lion and the Mouse"


def trained_runs(tokenizer, sample: TokenizedSample) -> list[str]:
    """Decode each maximal run of tokens that carry a label (checking each label equals its token)."""
    runs, current = [], []
    for token, label in [*zip(sample.input_ids, sample.labels, strict=True), (None, -100)]:
        if label == -100:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            assert label == token
            current.append(token)
    return runs


def test_chat_labels_cover_exactly_the_assistant_replies(tokenizer) -> None:
    sample = tokenize_chat(CONVERSATION, tokenizer)
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert trained_runs(tokenizer, sample) == [reply + IM_END for reply in replies]


def test_chat_opening_with_the_assistant_and_an_empty_reply(tokenizer) -> None:
    messages = [
        {"role": "assistant", "content": "Good day, traveller."},
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ]
    assert trained_runs(tokenizer, tokenize_chat(messages, tokenizer)) == ["Good day, traveller." + IM_END, IM_END]


def test_chat_mask_agrees_with_transformers_generation_mask(tokenizer) -> None:
    """Cross-check against `return_assistant_tokens_mask`, which the test template supports via {% generation %}."""
    sample = tokenize_chat(CONVERSATION, tokenizer)
    reference = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(sample.input_ids) == list(reference["input_ids"])
    assert [int(label != -100) for label in sample.labels] == list(reference["assistant_masks"])


def test_chat_sample_dispatch_and_template_without_generation_markers(tokenizer, tokenizer_dir) -> None:
    sample = ChatSample((ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello there.")))
    via_dispatch = tokenize_sample(sample, tokenizer)
    plain = load_tokenizer(tokenizer_dir)  # a private copy: the session tokenizer stays untouched
    plain.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    assert tokenize_chat(messages, plain) == via_dispatch


def test_template_whose_prefixes_do_not_extend_is_rejected(tokenizer_dir) -> None:
    odd = load_tokenizer(tokenizer_dir)
    # Renders the number of messages first, so a shorter prefix is not a prefix of the longer rendering.
    odd.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="prefixes"):
        tokenize_chat(CONVERSATION, odd)


def test_tokenized_sample_validates_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        TokenizedSample((1, 2), (1,))
    with pytest.raises(ValueError, match="at least one token"):
        TokenizedSample((), ())
