"""Diffusion-DPO on the video DiTs (Wan T2V, HunyuanVideo): pairs of video files (written here with PyAV), encoded
at the rollout's ``sampling`` size and frame count. A 2-iteration LoRA run on each (latents of the rollout's shape;
step 1 at the reference: ``-log sigmoid(0) = log 2``; the policy moved), a bitwise resume (2 + 2 == 4) and SP=2
against one process on Wan, and the pair file's one-line errors: a video shorter than ``sampling.frames``, an image
given to a video model, a video given to an image model, an undecodable file. The objective itself is checked
against the paper's formula in ``test_algorithms_nft_dpo.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.rl.common import SAMPLING, rl_config, start

FRAMES = SAMPLING["wan"]["frames"]  # 5 (4k + 1), HunyuanVideo's too


def _video(path: Path, seed: int, frames: int, flat: bool = False) -> str:
    """Random pixels per frame, or (``flat``) one random colour: two videos the model's errors differ on. Sizes other
    than the run's (40 x 36): resized and cropped."""
    from runtime.data.dit.synthetic import write_video

    rng = np.random.default_rng(seed)
    shape = (frames, 1, 1, 3) if flat else (frames, 36, 40, 3)
    clip = np.broadcast_to(rng.integers(0, 256, shape, dtype=np.uint8), (frames, 36, 40, 3))
    write_video(path, list(np.ascontiguousarray(clip)))
    return path.name


def write_video_pairs(directory: Path, count: int = 4, frames: int = FRAMES) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        chosen = _video(directory / f"w{i}.mp4", 2 * i, frames)
        rejected = _video(directory / f"l{i}.mp4", 2 * i + 1, frames, flat=True)
        lines.append(json.dumps({"prompt": f"a clip number {i}", "chosen": chosen, "rejected": rejected}))
    path = directory / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def video_dpo_raw(model: str, tiny_pipelines, tmp_path: Path, **sections) -> dict:
    """A 2-step LoRA DPO run of ``model`` on 4 video pairs, 2 per iteration."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    raw = rl_config(model, tiny_pipelines(model), tmp_path, optim={"lr": 1e-2}, **sections)
    for key in ("flowgrpo", "rewards"):
        raw.pop(key)
    raw["data"] = {"pairs": str(write_video_pairs(tmp_path / "pairs")), "prompts_per_step": 2}
    raw["sampling"].pop("true_cfg_scale", None)  # dpo trains the conditional prediction
    return {**raw, "algorithm": "dpo", "dpo": {"beta": 500.0}}


@pytest.mark.parametrize("model", ["wan", "hunyuanvideo"])
def test_video_dpo_trains_from_the_reference(model: str, tiny_pipelines, tmp_path: Path) -> None:
    """The pairs' latents have the rollout's latent shape (``sampling`` size and frame count). Step 1: the LoRA policy
    is its LoRA-disabled reference (B = 0), so ``d = 0``: loss ``log 2``, no pair preferred; the updates move the
    policy; at step 2 the policy's errors differ from the reference's."""
    from runtime.rl.loop import iteration
    from runtime.rl.offline import _latents
    from tests.rl.common import trainable_state

    run, _ = start(video_dpo_raw(model, tiny_pipelines, tmp_path))
    s, cm = run.config.sampling, run.policy.adapter.condition_model
    for latents in _latents(run, run.prompts[:2]):
        assert latents.shape == (2, *cm.sampling_latent_shape(s.height, s.width, s.frames)), latents.shape
    before = trainable_state(run.policy)
    first, _ = iteration(run, 1)
    assert first["policy_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["implicit_reward_accuracy"] == 0.0 and first["implicit_reward_margin"] == pytest.approx(0.0)
    assert first["error_chosen"] == pytest.approx(first["error_chosen_ref"], rel=1e-6)
    second, _ = iteration(run, 2)
    after = trainable_state(run.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the policy did not move"
    assert second["error_chosen"] != second["error_chosen_ref"] and math.isfinite(second["policy_loss"])


def test_video_dpo_resumes_bitwise(tiny_pipelines, tmp_path: Path) -> None:
    """Wan: 4 steps in one run == 2 steps, a checkpoint, then 2 more resumed from it (metrics but timings, and every
    trainable parameter, bitwise)."""
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl
    from runtime.rl.metrics import TIMING_KEYS
    from tests.rl.common import trainable_state

    ckpt = tmp_path / "ckpt"
    raw = video_dpo_raw("wan", tiny_pipelines, tmp_path, train={"steps": 4})
    raw = {**raw, "checkpoint": {"dir": str(ckpt), "interval": 2}}
    whole = run_rl(parse_rl_config(raw))
    resumed = run_rl(
        parse_rl_config({**raw, "checkpoint": {**raw["checkpoint"], "resume": str(ckpt / "step_000002")}})
    )
    assert resumed.start_step == 2 and len(resumed.metrics) == 2
    strip = [
        [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in r] for r in (whole.metrics[2:], resumed.metrics)
    ]
    assert strip[0] == strip[1]
    a, b = trainable_state(whole.policy), trainable_state(resumed.policy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pairs_of_the_wrong_media_are_one_line_errors(tiny_pipelines, tmp_path: Path, capsys) -> None:
    """Checked before the model is built, one line each naming the pair file and line: a video shorter than
    ``sampling.frames`` (through ``python -m runtime.rl``: exit 2), an image for a video model, a video for an image
    model, a file PyAV cannot read."""
    from runtime.rl.pairs import read_pairs
    from tests.rl.test_cli import _run
    from tests.rl.test_dpo import write_pairs

    short = write_video_pairs(tmp_path / "short", count=1, frames=FRAMES - 2)
    raw = video_dpo_raw("wan", tiny_pipelines, tmp_path / "run")
    code, _, err = _run(tmp_path, {**raw, "data": {**raw["data"], "pairs": str(short)}}, capsys)
    expected = f"data.pairs: {short}:1: \"chosen\": 'w0.mp4' has {FRAMES - 2} frames; the model needs {FRAMES}"
    assert code == 2 and expected in err and err.count("\n") == 1 and "Traceback" not in err, err

    images, videos = write_pairs(tmp_path / "images", 1), Path(raw["data"]["pairs"])
    broken = tmp_path / "run" / "pairs" / "broken.jsonl"
    (broken.parent / "junk.mp4").write_bytes(b"not a video")
    broken.write_text(json.dumps({"prompt": "a", "chosen": "junk.mp4", "rejected": "l0.mp4"}) + "\n")
    for path, frames, words in (
        (images, FRAMES, "\"chosen\": 'w0.png' is an image; the model generates videos"),
        (videos, None, "\"chosen\": 'w0.mp4' is not a PNG or JPEG file"),
        (broken, FRAMES, f'"chosen": cannot read video {broken.parent / "junk.mp4"}: '),
    ):
        with pytest.raises(ValueError) as info:
            read_pairs(path, frames)
        assert str(info.value).startswith(f"{path}:1: {words}") and "\n" not in str(info.value), str(info.value)


@pytest.mark.dist
def test_video_sp2_equals_one_process(tiny_pipelines, tmp_path: Path) -> None:
    """Wan, full fine-tuning against a frozen copy: iteration 1 at SP=2 (the video tokens split over the ranks) has
    the metrics and every weight's gradient of one process under the rounding model (``test_dpo._compare``). The text
    path (the cross-attention keys / values and the text embedder) is where a fixed fraction fails: its gradients
    are sums over every video token (split over the ranks) of terms that cancel (softmax: a key's gradients sum to 0
    over the keys), measured 9.7e-5 of themselves apart under SP, and the witness run moves them alike."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import references
    from tests.rl.test_dpo import _compare, dpo_iteration

    raw = video_dpo_raw("wan", tiny_pipelines, tmp_path, lora={"rank": None})
    raw = {**raw, "reference": "frozen_copy", "dpo": {"beta": 50.0}}
    ref, witness = references(dpo_iteration, raw)
    reason = "cross-attention q/k: sums over every video token of terms the softmax cancels, beta = 50"
    weak = (("attn2.to_q.", reason), ("attn2.to_k.", reason))
    for got in run_distributed(dpo_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300):
        _compare(got, ref, witness, weak)
