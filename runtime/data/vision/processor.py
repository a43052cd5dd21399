"""Qwen-VL processors: load one from a local directory, build a tiny one for tests and demos, read its token ids.

The data pipeline uses a processor for its chat template, tokenizer, image processor and vision-token strings
(``vision/tokenization.py``). transformers 5.14.1 builds a ``Qwen3VLProcessor`` / ``Qwen2_5_VLProcessor`` only
together with a video processor, and every video processor (like ``AutoImageProcessor`` and ``AutoProcessor`` for
these models) requires torchvision. Where torchvision is missing (the CPU dev and CI machines: PyPI has no
torchvision wheel for the CPU torch build), ``load_processor`` builds the same upstream processor class from its
tokenizer and the PIL image processor, without a video processor; the pipeline never calls the video processor (see
``runtime/data/vision/video.py``), so both ways tokenize identically.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from runtime.data.text.corpus import corpus_path
from runtime.data.text.tokenization import build_test_tokenizer
from runtime.models.registry import REGISTRY, lookup
from runtime.models.tiny_configs import tiny_vision_config

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# The Qwen layout: an image is <|vision_start|><|image_pad|><|vision_end|>, a video the same with <|video_pad|>;
# the pipeline expands each pad into the right number of tokens. String content works too (text-only turns).
VLM_TEST_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _WithoutVideoProcessor:
    """Lets an upstream processor be built with ``video_processor=None`` (its __init__ otherwise refuses)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _image_only(processor_class: str) -> type:
    """Upstream processor class ``processor_class`` without a video processor, for machines without torchvision."""
    base = getattr(transformers, processor_class, None)
    if base is None or not hasattr(base, "check_argument_for_proper_class"):
        raise ValueError(f"transformers {transformers.__version__} has no processor class {processor_class!r}")
    return type(f"ImageOnly{processor_class}", (_WithoutVideoProcessor, base), {})


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path} not found: a processor directory needs it (save the processor with "
            f"save_pretrained, or build one with build_test_processor)"
        ) from None


def _chat_template(path: Path, tokenizer) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_template.json").is_file():
        return _read_json(path / "chat_template.json").get("chat_template")
    return tokenizer.chat_template


def _pil_image_processor(path: Path):
    """The PIL variant of the image processor class that ``preprocessor_config.json`` names."""
    name = _read_json(path / "preprocessor_config.json").get("image_processor_type", "")
    base = name.removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, base + "Pil", None)
    if cls is None:
        raise ValueError(
            f"{path / 'preprocessor_config.json'}: image_processor_type {name!r} has no PIL variant "
            f"({base}Pil); without torchvision only PIL image processors can be loaded"
        )
    return cls.from_pretrained(str(path))


def _load_image_only(path: Path):
    name = _read_json(path / "processor_config.json").get("processor_class")
    known = sorted({m.data["processor"] for m in REGISTRY.values() if "processor" in m.data})
    if name not in known:
        raise ValueError(
            f"{path / 'processor_config.json'}: processor_class {name!r} needs torchvision in "
            f"transformers {transformers.__version__}; without it only {', '.join(known)} load"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return _image_only(name)(
        image_processor=_pil_image_processor(path),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=_chat_template(path, tokenizer),
    )


def load_processor(path: str | Path):
    """A Qwen-VL processor from a local directory (never the Hub: a path that does not exist is an error here).

    With torchvision installed this is ``AutoProcessor.from_pretrained``; without it, the same upstream processor
    class built without its video processor (see the module docstring).
    """
    from transformers.utils import is_torchvision_available

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"processor directory not found: {path}")
    if is_torchvision_available():
        return transformers.AutoProcessor.from_pretrained(str(path))
    return _load_image_only(path)


def vlm_token_ids(processor) -> dict[str, int]:
    """The vision token ids a model config needs (``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
    ``vision_end_token_id``), read from the processor's tokenizer; ValueError if one is not a token."""
    tokenizer = processor.tokenizer
    tokens = {
        "image_token_id": getattr(processor, "image_token", IMAGE_PAD),
        "video_token_id": getattr(processor, "video_token", VIDEO_PAD),
        "vision_start_token_id": getattr(processor, "vision_start_token", VISION_START),
        "vision_end_token_id": getattr(processor, "vision_end_token", VISION_END),
    }
    return token_ids(tokenizer, tokens)


def token_ids(tokenizer, tokens: dict[str, str]) -> dict[str, int]:
    """Config key -> the id of its token in `tokenizer`; ValueError naming the token when it is not one."""
    ids = {}
    for key, token in tokens.items():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"the processor's tokenizer has no token {token!r} (needed for {key})")
        ids[key] = token_id
    return ids


def build_test_processor(
    directory: str | Path,
    model_type: str = "qwen3_vl",
    min_pixels: int = 8 * 8,
    max_pixels: int = 32 * 32,
    vocab_size: int = 512,
) -> Path:
    """Save a tiny processor of ``model_type``'s family to ``directory`` and return the path.

    The tokenizer is the test BPE trained on the shipped corpus (``build_test_tokenizer``) with the Qwen vision
    tokens added as special tokens; patch, temporal patch and merge sizes match the model's tiny vision config, and
    the small pixel bounds keep a 16x24 image at 4x6 patches (6 tokens after the 2x2 merge). The directory holds what
    ``AutoProcessor.from_pretrained`` reads (tokenizer, image and video processor configs, ``processor_config.json``,
    the chat template); ``load_processor`` loads it with or without torchvision.
    """
    data = lookup(model_type).data
    if "processor" not in data:
        raise ValueError(f"model_type {model_type!r}: its spec's [model.data] names no processor")
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    processor_class, video_class = data["processor"], data["video_processor"]
    vision = tiny_vision_config(model_type)
    directory = Path(directory)
    build_test_tokenizer(
        directory,
        corpus_path().read_text(encoding="utf-8"),
        vocab_size,
        extra_special_tokens=VISION_TOKENS,
        chat_template=VLM_TEST_CHAT_TEMPLATE,
    )
    sizes = dict(
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        **{key: data[key] for key in ("image_mean", "image_std") if key in data},
    )
    pixels = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    transformers.Qwen2VLImageProcessorPil(size=pixels, **sizes).save_pretrained(str(directory))
    # So that AutoProcessor (with torchvision) finds a complete processor; the pipeline itself does not use it.
    # Written as JSON because the video processor classes cannot be instantiated without torchvision.
    video = {
        "video_processor_type": video_class,
        "do_sample_frames": False,
        **sizes,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels * 8},
    }  # bounds frames x h x w
    write_json(directory / "video_preprocessor_config.json", video)
    write_json(directory / "processor_config.json", {"processor_class": processor_class})
    return directory


def write_json(path: Path, value: dict) -> None:
    """A processor directory's JSON file, written as ``save_pretrained`` would (sorted keys, indented)."""
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
