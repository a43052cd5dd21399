"""Rewards scored by a local vision-language model (transformers): a yes/no judge and an OCR accuracy.

Both load a VLM checkpoint directory saved by transformers (model and processor, e.g. ``Qwen/Qwen2.5-VL-7B-Instruct``
downloaded beforehand; nothing is fetched) with ``AutoModelForImageTextToText`` and the directory's processor
(``runtime.data.vision.processor.load_processor``: works without torchvision too), and ask one chat question per
sample, the image first, through the processor's chat template.

* ``vlm_judge``: ``question`` (default ``DEFAULT_QUESTION``, ``{prompt}`` replaced by the sample's prompt) and the
  score ``p(yes) / (p(yes) + p(no))`` from the logits of the answer's first token (the first token of ``yes`` and of
  ``no`` as the tokenizer splits them; they must differ). In [0, 1]; the VQAScore-style judge reward.
* ``ocr``: the VLM reads the image (``question`` default ``OCR_QUESTION``, greedy decoding, ``max_new_tokens``), and
  the score is flow_grpo's OCR accuracy against the text between the first pair of double quotes in the prompt (the
  whole prompt when it has none): both lower-cased without spaces, distance 0 when the target occurs in the reading,
  else the Levenshtein distance capped at the target's length; ``1 - distance / len(target)`` in [0, 1].
  flow_grpo reads with PaddleOCR; here any VLM the user trusts reads (the formula is theirs, the reader is not).

A video's frames are scored one by one and averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

__all__ = [
    "DEFAULT_QUESTION",
    "OCR_QUESTION",
    "VlmJudgeReward",
    "VlmOcrReward",
    "levenshtein",
    "ocr_accuracy",
    "save_tiny_vlm",
]

DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer yes or no.'
OCR_QUESTION = "What text is written in this image? Answer with the text only."


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def ocr_target(prompt: str) -> str:
    """The text a prompt asks to render: between its first pair of double quotes, else the whole prompt."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else prompt


def ocr_accuracy(read: str, target: str) -> float:
    """flow_grpo's OCR reward of one reading against one target text (module docstring)."""
    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        return 0.0
    distance = 0 if target in read else min(levenshtein(read, target), len(target))
    return 1 - distance / len(target)


class _VlmReward:
    """Loads the VLM and turns samples into chat inputs; subclasses score them."""

    def __init__(self, model: Any, processor: Any, question: str, batch_size: int = 8) -> None:
        self.model, self.processor, self.question, self.batch_size = model.eval(), processor, question, batch_size

    @classmethod
    def from_pretrained(cls, path: str, question: str | None = None, batch_size: int = 8, **kwargs: Any) -> Any:
        from transformers import AutoModelForImageTextToText

        from runtime.data.vision.processor import load_processor

        model = AutoModelForImageTextToText.from_pretrained(str(Path(path)))
        return cls(model, load_processor(path), question or cls.default_question, batch_size, **kwargs)

    default_question = DEFAULT_QUESTION

    def _inputs(self, images: list[PIL.Image.Image], prompts: Sequence[str]) -> Any:
        texts = [
            self.processor.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": self.question.replace("{prompt}", prompt)},
                        ],
                    }
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
            for prompt in prompts
        ]
        tokenizer = self.processor.tokenizer
        tokenizer.padding_side = "left"  # the next token of every row is at the last position
        device = next(self.model.parameters()).device
        return self.processor(text=texts, images=images, padding=True, return_tensors="pt").to(device)

    def _score_images(self, images: list[PIL.Image.Image], prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from runtime.rl.rewards.http import to_uint8

        frames = samples.unbind(2) if samples.ndim == 5 else (samples,)
        per_frame = []
        for frame in frames:
            images = [PIL.Image.fromarray(to_uint8(x)) for x in frame]
            chunks = [
                self._score_images(images[i : i + self.batch_size], list(prompts[i : i + self.batch_size]))
                for i in range(0, len(images), self.batch_size)
            ]
            per_frame.append(torch.cat(chunks).float().cpu())
        return torch.stack(per_frame).mean(dim=0)


class VlmJudgeReward(_VlmReward):
    """``p(yes) / (p(yes) + p(no))`` of the VLM's answer to the question about each sample."""

    def __init__(self, model: Any, processor: Any, question: str, batch_size: int = 8) -> None:
        super().__init__(model, processor, question, batch_size)
        tokenizer = processor.tokenizer
        self.yes, self.no = (tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in ("yes", "no"))
        if self.yes == self.no:
            raise ValueError("the tokenizer gives 'yes' and 'no' the same first token; the judge cannot tell them")

    @torch.no_grad()
    def _score_images(self, images: list[PIL.Image.Image], prompts: Sequence[str]) -> torch.Tensor:
        logits = self.model(**self._inputs(images, prompts)).logits[:, -1].float()
        return torch.softmax(logits[:, [self.yes, self.no]], dim=-1)[:, 0]


class VlmOcrReward(_VlmReward):
    """flow_grpo's OCR accuracy of what the VLM reads in each sample (greedy decoding)."""

    default_question = OCR_QUESTION

    def __init__(self, model: Any, processor: Any, question: str, batch_size: int = 8, max_new_tokens: int = 32):
        super().__init__(model, processor, question, batch_size)
        self.max_new_tokens = max_new_tokens

    def read(self, images: list[PIL.Image.Image]) -> list[str]:
        """What the VLM reads in each image (its greedy answer, special tokens dropped)."""
        inputs = self._inputs(images, [""] * len(images))
        with torch.no_grad():
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens)
        answers = out[:, inputs["input_ids"].shape[1] :]
        return self.processor.tokenizer.batch_decode(answers, skip_special_tokens=True)

    def _score_images(self, images: list[PIL.Image.Image], prompts: Sequence[str]) -> torch.Tensor:
        readings = self.read(images)
        return torch.tensor([ocr_accuracy(r, ocr_target(p)) for r, p in zip(readings, prompts, strict=True)])


def save_tiny_vlm(directory: str | Path, model_type: str = "qwen2_vl", seed: int = 0) -> Path:
    """A tiny random VLM checkpoint (upstream transformers class, with the test processor) for tests and demos: the
    rewards load it through the same code as a real one. No download."""
    import transformers

    from runtime.data.vision.processor import build_test_processor, load_processor, vlm_token_ids
    from runtime.models.tiny_configs import tiny_vision_config, tiny_vlm_text_config

    directory = Path(directory)
    build_test_processor(directory, model_type)
    text = {**tiny_vlm_text_config(model_type), "vocab_size": 576, "max_position_embeddings": 512}
    config = transformers.AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=tiny_vision_config(model_type),
        tie_word_embeddings=False,
        **vlm_token_ids(load_processor(directory)),
    )
    torch.manual_seed(seed)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(directory)
    return directory
