"""The checkpoint-free and model rewards verl-omni / flow_grpo users score with: JPEG (in)compressibility, the LAION
aesthetic predictor, a VLM yes/no judge and a VLM-read OCR accuracy, each against a float64 re-derivation of the
peers' formula (docs/flowgrpo.md, Rewards)."""

from __future__ import annotations

import functools
import io

import numpy as np
import PIL.Image
import pytest
import torch

from runtime.config.errors import ConfigError
from runtime.rl.reward_entries import reward_entry_problems
from runtime.rl.rewards import build_rewards
from runtime.rl.rewards.aesthetic import AestheticReward
from runtime.rl.rewards.jpeg import JpegSizeReward
from runtime.rl.rewards.models import save_tiny_clip
from runtime.rl.rewards.vlm import VlmJudgeReward, VlmOcrReward, ocr_accuracy, save_tiny_vlm


def _images(seed: int, n: int = 3, h: int = 16, w: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g) * 2 - 1


def _uint8(x: torch.Tensor) -> np.ndarray:
    """The peers' conversion of [-1, 1] pixels: (x / 2 + 0.5) * 255, rounded, HWC."""
    return ((x.double() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def _jpeg_kb(x: torch.Tensor) -> float:
    buffer = io.BytesIO()
    PIL.Image.fromarray(_uint8(x)).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def test_jpeg_rewards_are_the_peers_size_in_kilobytes():
    x = _images(0)
    kb = torch.tensor([_jpeg_kb(s) for s in x], dtype=torch.float64)
    torch.testing.assert_close(JpegSizeReward("jpeg_incompressibility")(x, [""] * 3).double(), kb, rtol=1e-6, atol=0)
    # flow_grpo / verl-omni: -kB / 500; DDPO: -kB (scale 1). float32 output of a float64 value: rtol 1e-6.
    torch.testing.assert_close(
        JpegSizeReward("jpeg_compressibility")(x, [""] * 3).double(), -kb / 500, rtol=1e-6, atol=0
    )
    torch.testing.assert_close(
        JpegSizeReward("jpeg_compressibility", 1.0)(x, [""] * 3).double(), -kb, rtol=1e-6, atol=0
    )
    video = torch.stack([x, _images(1)], dim=2)  # (B, 3, F=2, H, W): the frames' mean
    both = (kb + torch.tensor([_jpeg_kb(s) for s in _images(1)], dtype=torch.float64)) / 2
    torch.testing.assert_close(
        JpegSizeReward("jpeg_incompressibility")(video, [""] * 3).double(), both, rtol=1e-6, atol=0
    )


@functools.cache
def _levenshtein(a: str, b: str) -> int:
    """Edit distance by its recursive definition (not the reward's dynamic programme)."""
    if not a or not b:
        return len(a) + len(b)
    return min(_levenshtein(a[1:], b) + 1, _levenshtein(a, b[1:]) + 1, _levenshtein(a[1:], b[1:]) + (a[0] != b[0]))


def _flow_grpo_ocr(read: str, prompt: str) -> float:
    target = prompt.split('"')[1].replace(" ", "").lower()
    read = read.replace(" ", "").lower()
    distance = 0 if target in read else min(_levenshtein(read, target), len(target))
    return 1 - distance / len(target)


@pytest.mark.parametrize(
    "read",
    ["Hello World", "hello", "xx HELLO WORLD yy", "helo wrld", "", "an entirely unrelated long reading"],
)
def test_ocr_accuracy_is_flow_grpos(read):
    prompt = 'a shop sign reading "Hello World" at night'
    assert ocr_accuracy(read, "Hello World") == pytest.approx(_flow_grpo_ocr(read, prompt), abs=0)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm"))


def test_aesthetic_is_laions_linear_head_on_the_normalised_clip_embedding(clip_dir, tmp_path):
    from transformers import CLIPImageProcessor, CLIPModel

    g = torch.Generator().manual_seed(0)
    dims = [8, 12, 6, 5, 4, 1]  # LAION's head: Linear at layers.0/2/4/6/7 (dropout between), tiny widths here
    state = {}
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), zip(dims, dims[1:], strict=False), strict=True):
        state[f"layers.{index}.weight"] = torch.randn(n_out, n_in, generator=g)
        state[f"layers.{index}.bias"] = torch.randn(n_out, generator=g)
    torch.save(state, tmp_path / "head.pth")
    x = _images(2)
    reward = AestheticReward.from_pretrained(str(clip_dir), str(tmp_path / "head.pth"))(x, [""] * 3)

    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPImageProcessor.from_pretrained(clip_dir)
    pixels = processor(images=[PIL.Image.fromarray(_uint8(s)) for s in x], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        e = model.get_image_features(pixel_values=pixels).pooler_output.double()
    y = e / e.norm(dim=-1, keepdim=True)
    for index in (0, 2, 4, 6, 7):
        y = y @ state[f"layers.{index}.weight"].double().T + state[f"layers.{index}.bias"].double()
    # fp32 CLIP + head vs the same embedding through an fp64 head: rounding of five small matmuls.
    torch.testing.assert_close(reward.double(), y[:, 0], rtol=1e-5, atol=1e-5)


def test_vlm_judge_is_yes_over_yes_plus_no_and_each_sample_scores_alone(vlm_dir):
    judge = VlmJudgeReward.from_pretrained(str(vlm_dir))
    x, prompts = _images(3), ["a red cube", 'a sign "open"', "two cats on a very long sofa"]
    scores = judge(x, prompts)
    expected = []
    for sample, prompt in zip(x, prompts, strict=True):  # one at a time: no padding
        inputs = judge._inputs([PIL.Image.fromarray(_uint8(sample))], [prompt])
        with torch.no_grad():
            logits = judge.model(**inputs).logits[0, -1].double()
        p = torch.softmax(logits, dim=-1)
        expected.append(p[judge.yes] / (p[judge.yes] + p[judge.no]))
    # fp32 logits, batched with left padding vs alone: summation order only.
    torch.testing.assert_close(scores.double(), torch.stack(expected), rtol=1e-5, atol=1e-5)
    tokenizer = judge.processor.tokenizer
    assert tokenizer.decode([judge.yes]).strip().startswith("y") and tokenizer.decode([judge.no]).strip()[0] == "n"


def test_ocr_reward_is_flow_grpos_accuracy_of_what_the_vlm_reads(vlm_dir):
    ocr = VlmOcrReward.from_pretrained(str(vlm_dir), max_new_tokens=4)
    x, prompts = _images(4, n=2), ['"abc"', 'a poster saying "Big Sale"']
    readings = []
    for sample in x:  # the test's own greedy decode of each sample alone
        inputs = ocr._inputs([PIL.Image.fromarray(_uint8(sample))], [""])
        with torch.no_grad():
            out = ocr.model.generate(**inputs, do_sample=False, max_new_tokens=4)
        readings.append(
            ocr.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        )
    expected = torch.tensor([_flow_grpo_ocr(r, p) for r, p in zip(readings, prompts, strict=True)])
    torch.testing.assert_close(ocr(x, prompts).double(), expected.double(), rtol=0, atol=1e-7)


def test_the_new_kinds_build_from_a_config_and_their_mistakes_are_named(clip_dir, vlm_dir, tmp_path):
    torch.save({"layers.0.weight": torch.ones(1, 8), "layers.0.bias": torch.zeros(1)}, tmp_path / "head.pth")
    mix = build_rewards(
        [
            {"jpeg_compressibility": True},
            {"jpeg_incompressibility": True, "scale": 0.5, "weight": 0.1},
            {"aesthetic": str(clip_dir), "head": str(tmp_path / "head.pth")},
            {"vlm_judge": str(vlm_dir), "question": "Is it {prompt}? yes or no"},
            {"ocr": str(vlm_dir), "max_new_tokens": 2},
        ]
    )
    assert mix.names == ["jpeg_compressibility0", "jpeg_incompressibility1", "aesthetic2", "vlm_judge3", "ocr4"]
    combined, each = mix(_images(5, n=2), ['"a"', '"b"'])
    assert combined.shape == (2,) and torch.isfinite(combined).all() and set(each) == set(mix.names)

    problems = reward_entry_problems(0, {"jpeg_compressibility": "yes", "scale": -1})
    assert problems == [
        "rewards[0].jpeg_compressibility: expected true (the reward takes no checkpoint), found 'yes'",
        "rewards[0].scale: expected a positive number, found -1",
    ]
    assert reward_entry_problems(1, {"aesthetic": str(clip_dir)}) == [
        "rewards[1].head: required: the predictor head's weights (.safetensors or .pth), found None"
    ]
    assert reward_entry_problems(2, {"ocr": str(vlm_dir), "head": "x"})[0].startswith("rewards[2].head: unknown key")
    with pytest.raises(ConfigError, match=r"rewards\[0\].vlm_judge: cannot load a VLM checkpoint"):
        build_rewards([{"vlm_judge": str(clip_dir)}])
