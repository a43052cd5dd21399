"""The omni processor: build a tiny one for tests and demos, load one from a local directory, read its token ids.

The class is the generated ``Qwen3OmniMoeProcessor`` (``specs/qwen3_omni_moe_processor.toml``: upstream's with empty
input lists treated as absent, ``audios=`` accepted, and buildable without a video processor). It is always built
from its parts without a video processor: every transformers 5.14.1 video processor needs torchvision, which the CPU
machines cannot install, and the data pipeline feeds video frames through the image processor
(``vision/video.py``), so every machine tokenizes alike. A processor directory holds the tokenizer (with the
omni special tokens as named attributes), ``preprocessor_config.json`` carrying both the image processor's and the
Whisper feature extractor's settings (as the published Qwen3-Omni checkpoints do), ``processor_config.json`` and the
chat template.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import transformers

from runtime.data.text.corpus import corpus_path
from runtime.data.text.tokenization import build_test_tokenizer
from runtime.data.vision.processor import token_ids, write_json
from runtime.models.registry import lookup
from runtime.models.tiny_configs import tiny_config_dict

# The tokenizer attributes Qwen3OmniMoeProcessor reads, and the strings of the published checkpoints.
OMNI_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# model config key -> tokenizer attribute
_CONFIG_TOKENS = {
    "image_token_id": "image_token",
    "video_token_id": "video_token",
    "audio_token_id": "audio_token",
    "vision_start_token_id": "vision_bos_token",
    "vision_end_token_id": "vision_eos_token",
    "audio_start_token_id": "audio_bos_token",
    "audio_end_token_id": "audio_eos_token",
}

# Media parts become the Qwen-Omni placeholders; the processor expands each (a video with its audio track becomes
# the interleaved audio-in-video block). String content works too (text-only turns).
OMNI_TEST_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'audio' %}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def processor_class(model_type: str) -> type:
    """The generated processor class the model's spec names in ``[model.data] processor_class``."""
    dotted = lookup(model_type).data.get("processor_class")
    if not dotted:
        raise ValueError(f"model_type {model_type!r}: its spec's [model.data] names no processor_class")
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path} not found: an omni processor directory needs it (build_omni_test_processor)"
        ) from None


def load_omni_processor(path: str | Path, model_type: str = "qwen3_omni_moe_thinker", cls: type | None = None):
    """The generated omni processor (``cls``, default the one ``model_type``'s spec names) from a local directory
    (tokenizer, image processor, feature extractor, chat template), without a video processor (see the module
    docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"processor directory not found: {path}")
    config = _read_json(path / "preprocessor_config.json")
    name = config.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
    image_cls = getattr(transformers, name + "Pil", None)
    if image_cls is None:
        raise ValueError(f"{path / 'preprocessor_config.json'}: image_processor_type {name!r} has no PIL variant")
    if config.get("feature_extractor_type") != "WhisperFeatureExtractor":
        raise ValueError(
            f"{path / 'preprocessor_config.json'}: feature_extractor_type must be WhisperFeatureExtractor, found "
            f"{config.get('feature_extractor_type')!r}"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    missing = [attr for attr in OMNI_SPECIAL_TOKENS if not getattr(tokenizer, attr, None)]
    if missing:
        raise ValueError(f"{path}: the tokenizer does not name the omni special tokens {missing}")
    template = path / "chat_template.jinja"
    return (cls or processor_class(model_type))(
        image_processor=image_cls.from_pretrained(str(path)),
        video_processor=None,
        feature_extractor=transformers.WhisperFeatureExtractor.from_pretrained(str(path)),
        tokenizer=tokenizer,
        chat_template=template.read_text(encoding="utf-8") if template.is_file() else tokenizer.chat_template,
    )


def omni_token_ids(processor) -> dict[str, int]:
    """The special-token ids a thinker config needs, read from the processor's tokenizer."""
    tokenizer = processor.tokenizer
    return token_ids(tokenizer, {key: getattr(tokenizer, attr) for key, attr in _CONFIG_TOKENS.items()})


def build_omni_test_processor(
    directory: str | Path,
    model_type: str = "qwen3_omni_moe_thinker",
    min_pixels: int = 8 * 8,
    max_pixels: int = 32 * 32,
    vocab_size: int = 512,
    tiny: Mapping[str, Any] | None = None,
) -> Path:
    """Save a tiny omni processor matching ``model_type``'s tiny config (patch/merge sizes, mel bins; or ``tiny``'s
    ``vision_config``/``audio_config`` where no generated model is installed) and return the path: the test BPE
    with the omni special tokens, a PIL Qwen2-VL image processor (a 16x24 image is 4x6 patches, 6 tokens after the
    2x2 merge) and a Whisper feature extractor at 16 kHz."""
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    tiny = tiny_config_dict(model_type) if tiny is None else tiny
    vision, audio = tiny["vision_config"], tiny["audio_config"]
    directory = Path(directory)
    build_test_tokenizer(
        directory,
        corpus_path().read_text(encoding="utf-8"),
        vocab_size,
        extra_special_tokens=tuple(OMNI_SPECIAL_TOKENS.values()),
        chat_template=OMNI_TEST_CHAT_TEMPLATE,
    )
    # re-save with the special tokens as named attributes (tokenizer.image_token, ...), which the processor reads
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), extra_special_tokens=OMNI_SPECIAL_TOKENS)
    tokenizer.save_pretrained(str(directory))
    image = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    features = transformers.WhisperFeatureExtractor(feature_size=audio["num_mel_bins"], sampling_rate=16000)
    merged = {**json.loads(image.to_json_string()), **json.loads(features.to_json_string())}
    write_json(directory / "preprocessor_config.json", merged)
    write_json(directory / "processor_config.json", {"processor_class": "Qwen3OmniMoeProcessor"})
    (directory / "chat_template.jinja").write_text(OMNI_TEST_CHAT_TEMPLATE, encoding="utf-8")
    return directory
