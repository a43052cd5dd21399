"""DiT data: the JSONL manifest, media decoding (PyAV, frame folders, PIL), buckets, the bucketed sampler, the
condition cache's keys and files, and the user errors a run stops on (one line naming file:line, exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.data.dit.buckets import Bucket, MediaRules, assign_bucket, parse_buckets
from runtime.data.dit.manifest import read_media_jsonl
from runtime.data.dit.media import MediaError, MediaInfo, load_frames, probe, to_pixels
from runtime.data.dit.sampler import BucketBatchSampler
from runtime.data.dit.synthetic import write_synthetic_clips, write_video
from runtime.data.sampler import Order

VIDEO = MediaRules(video=True, pixel_multiple=16, temporal_multiple=4)
IMAGE = MediaRules(video=False)


def _frames(count: int, height: int = 24, width: int = 40) -> list[np.ndarray]:
    """Smooth colour gradients that shift from frame to frame (what a video codec keeps well)."""
    y, x = np.mgrid[0:height, 0:width]
    return [
        np.stack([(x * 6 + 9 * t) % 256, (y * 9 + 5 * t) % 256, np.full_like(x, 40 * t % 256)], -1).astype(np.uint8)
        for t in range(count)
    ]


def _jsonl(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_manifest_reads_images_videos_and_frame_folders(tmp_path: Path) -> None:
    from PIL import Image

    (tmp_path / "f").mkdir()
    for t in (10, 2, 1):  # natural order: 1, 2, 10
        Image.new("RGB", (8, 8)).save(tmp_path / "f" / f"frame_{t}.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    write_video(tmp_path / "v.mp4", _frames(3))
    path = _jsonl(
        tmp_path,
        {"caption": "an image", "image": "a.png", "id": 7},
        "",
        {"caption": "a clip", "video": "v.mp4"},
        {"caption": "frames", "video": "f"},
        {"caption": "listed", "video": ["a.png", "f/frame_1.png"]},
    )
    samples = read_media_jsonl(path)
    assert [s.kind for s in samples] == ["image", "video", "frames", "frames"]
    assert [s.where for s in samples] == [f"{path}:1", f"{path}:3", f"{path}:4", f"{path}:5"]
    assert [p.name for p in samples[2].files] == ["frame_1.png", "frame_2.png", "frame_10.png"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ('{"caption": "x", "image": "missing.png"', "invalid JSON"),
        ({"caption": "x", "image": "missing.png"}, "image: file not found"),
        ({"caption": "x"}, "exactly one of the keys 'image' or 'video', found neither"),
        ({"caption": 3, "image": "a.png"}, "'caption' must be a string"),
        ({"caption": "x", "video": "a.png"}, "is an image; use the 'image' key"),
        ({"caption": "x", "video": "empty"}, "holds no images"),
        ({"caption": "x", "video": []}, "at least one frame"),
    ],
)
def test_manifest_errors_name_file_and_line(tmp_path: Path, record: object, message: str) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "empty").mkdir()
    path = _jsonl(tmp_path, {"caption": "fine", "image": "a.png"}, record)
    with pytest.raises(ValueError, match=message) as info:
        read_media_jsonl(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_video_file_and_frame_folder_decode_alike(tmp_path: Path) -> None:
    frames = _frames(9)
    path = _jsonl(tmp_path, {"caption": "c", "video": "v.mp4"})
    write_video(tmp_path / "v.mp4", frames)
    (sample,) = read_media_jsonl(path)
    assert probe(sample) == MediaInfo(40, 24, 9)
    decoded = load_frames(sample, 3, stride=4)  # frames 0, 4, 8
    assert len(decoded) == 3 and decoded[0].size == (40, 24)
    errors = [np.abs(np.asarray(decoded[2], dtype=float) - frame).mean() for frame in frames]
    assert errors[8] < 8 and errors[8] == min(errors)  # lossy H.264, but closest to the frame it encodes
    pixels = to_pixels(decoded, 16, 32, video=True)
    assert pixels.shape == (3, 3, 16, 32) and pixels.min() >= -1 and pixels.max() <= 1
    with pytest.raises(MediaError, match=r"decoded to 9 frames at stride 1, 10 needed"):
        load_frames(sample, 10)


def test_missing_pyav_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _jsonl(tmp_path, {"caption": "c", "video": "v.mp4"})
    write_video(tmp_path / "v.mp4", _frames(2))
    (sample,) = read_media_jsonl(path)
    monkeypatch.setitem(sys.modules, "av", None)  # import av -> ImportError
    with pytest.raises(MediaError, match=r"data.jsonl:1: decoding the video file .* needs PyAV \(`pip install av`"):
        probe(sample)


def test_resize_and_centre_crop() -> None:
    from PIL import Image

    image = np.zeros((20, 40, 3), dtype=np.uint8)
    image[:, 10:30] = 255  # a white band in the middle 20 columns
    pixels = to_pixels([Image.fromarray(image)], 16, 16, video=False)  # 20x40 -> 16x32 -> centre 16x16
    assert pixels.shape == (3, 16, 16)
    assert torch.all(pixels[:, :, 2:14] > 0.9)  # the band covers the centre crop


def test_buckets_parse_and_assign() -> None:
    buckets = parse_buckets([[9, 32, 48], [9, 32, 32], [1, 48, 48]], VIDEO)
    assert assign_bucket(MediaInfo(96, 64, 20), buckets) == Bucket(9, 32, 48)  # most frames, then aspect
    assert assign_bucket(MediaInfo(64, 64, 20), buckets) == Bucket(9, 32, 32)
    assert assign_bucket(MediaInfo(64, 64, 20), buckets, frame_stride=4) == Bucket(1, 48, 48)  # 5 frames at stride 4
    assert assign_bucket(MediaInfo(64, 64, 1), buckets) == Bucket(1, 48, 48)  # an image is a one-frame video
    assert assign_bucket(MediaInfo(64, 64, 1), buckets[:2]) is None
    for raw, message in [
        ([[8, 32, 32]], r"4k \+ 1"),
        ([[9, 30, 32]], "multiples of 16"),
        ([[32, 32]], r"\[frames, height, width\]"),
        ([], "non-empty list"),
        ([[9, 32, 32], [9, 32, 32]], "listed twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_buckets(raw, VIDEO)
    assert parse_buckets([[32, 48]], IMAGE) == [Bucket(1, 32, 48)]


def test_sampler_batches_by_bucket_and_splits_over_ranks_like_micro_batches() -> None:
    buckets = ["a", "b"] * 6 + ["a"]  # 7 a, 6 b
    one = BucketBatchSampler(buckets, batch_size=2, order=Order(seed=3))
    plan = one.plan(0)
    assert len(plan) == 6 and all(len({buckets[i] for i in batch}) == 1 for batch in plan)
    ranks = [BucketBatchSampler(buckets, batch_size=2, order=Order(seed=3, dp_rank=r, dp_size=2)) for r in range(2)]
    for _ in range(3):  # rank r's k-th batch is the single process's batch 2k + r
        assert [next(ranks[0]), next(ranks[1])] == [next(one), next(one)]
    state = ranks[0].state_dict()
    expected = [next(ranks[0]) for _ in range(5)]  # across the epoch boundary
    again = BucketBatchSampler(buckets, batch_size=2, order=Order(seed=3, dp_rank=0, dp_size=2))
    again.load_state_dict(state)
    assert [next(again) for _ in range(5)] == expected
    with pytest.raises(ValueError, match="batch_size: saved 2, now 3"):
        BucketBatchSampler(buckets, batch_size=3, order=Order(seed=3, dp_size=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="make fewer than dp_size=2 batches"):
        BucketBatchSampler(["a", "b"], batch_size=2, order=Order(dp_size=2))


def test_cache_keys_follow_content_and_shards_are_atomic(tmp_path: Path) -> None:
    from runtime.diffusion.cache import ConditionCache, FileDigests, condition_fingerprint, sample_key
    from runtime.diffusion.conditions.wan import WanConditionModel

    pipe = tmp_path / "pipe"
    for part in ("vae", "text_encoder", "transformer", "scheduler"):
        (pipe / part).mkdir(parents=True)
        (pipe / part / "config.json").write_text(json.dumps({"part": part}))
    digests = FileDigests(tmp_path / "memo.json")
    fingerprint = condition_fingerprint(pipe, "wan", WanConditionModel, digests)
    (pipe / "transformer" / "config.json").write_text("{}")  # the transformer does not feed get_condition
    (pipe / "scheduler" / "config.json").write_text("{}")  # nor does the scheduler
    assert condition_fingerprint(pipe, "wan", WanConditionModel, digests) == fingerprint
    (pipe / "vae" / "config.json").write_text(json.dumps({"part": "vae", "scale": 2}))  # the VAE does
    changed = condition_fingerprint(pipe, "wan", WanConditionModel, digests)
    assert changed != fingerprint

    key = sample_key(fingerprint, "cap", ["d1"], "video", [9, 32, 32], 1)
    assert len({key, sample_key(changed, "cap", ["d1"], "video", [9, 32, 32], 1),
                sample_key(fingerprint, "cap2", ["d1"], "video", [9, 32, 32], 1),
                sample_key(fingerprint, "cap", ["d2"], "video", [9, 32, 32], 1),
                sample_key(fingerprint, "cap", ["d1"], "video", [9, 32, 48], 1),
                sample_key(fingerprint, "cap", ["d1"], "video", [9, 32, 32], 2)}) == 6  # fmt: skip

    cache = ConditionCache(tmp_path / "cache")
    writer = cache.writer(max_samples=2)
    latents = torch.randn(4, 3, 4, 4)
    for index in range(3):
        writer.add(f"k{index}", latents + index, {"encoder_hidden_states": torch.full((5, 16), float(index))})
    writer.close()
    assert len(writer.written) == 2 and not list((tmp_path / "cache").glob(".*"))  # no temporary files left
    cache.refresh()
    got = cache.get("k2")
    assert torch.equal(got["latents"], latents + 2) and torch.equal(
        got["context"]["encoder_hidden_states"][0], torch.full((16,), 2.0)
    )
    writer.written[0].write_bytes(b"garbage")  # a damaged shard: its samples are missing, nothing else is
    cache.refresh()
    assert len(cache) == 1 and "k2" in cache and cache.unreadable

    # file digests are memoised by size + mtime, and a rewrite is seen
    media = tmp_path / "m.bin"
    media.write_bytes(b"one")
    first = digests.digest(media)
    digests.save()
    assert FileDigests(tmp_path / "memo.json").digest(media) == first
    media.write_bytes(b"two!")
    assert FileDigests(tmp_path / "memo.json").digest(media) != first


def test_user_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline
    from tests.train.common import run_main

    pipe = save_tiny_pipeline("wan", tmp_path / "pipe")
    data = write_synthetic_clips(tmp_path / "data", 2, 5, 32, 32)
    short = tmp_path / "short.jsonl"
    short.write_text(data.read_text().replace("clips/", "data/clips/"))
    base = {
        "model": {"type": "wan", "path": str(pipe)},
        "data": {"path": str(data), "buckets": [[5, 32, 32]]},
        "train": {"steps": 1},
        "log": {"dir": str(tmp_path / "log"), "progress": False},
    }
    cases = [
        (
            {"data": {**base["data"], "path": str(short), "buckets": [[9, 32, 32]]}},
            f"{short}:1: 5 frame(s) at frame_stride 1",
        ),
        (
            {"data": {**base["data"], "buckets": [[5, 30, 32]]}},
            "data.buckets[0]: height and width must be multiples of 16",
        ),
        ({"data": {**base["data"], "tokenizer": "tok"}}, "data.tokenizer: the DiT 'wan' reads its text encoders"),
        ({"model": {"type": "wan", "path": str(tmp_path)}}, "model.path: " + str(tmp_path) + ": no model_index.json"),
        ({"dit": {"condition": {"shfit": 3.0}}}, "dit.condition: {'shfit': 3.0}: "),
        ({"lora": {"rank": 4, "target_modules": ["nope"]}}, "lora.target_modules: ['nope']"),
        ({"parallel": {"sp": 3}}, "parallel: "),
        (
            {"model": {"type": "qwen3", "config": {}}, "data": {"path": str(data), "tokenizer": "t", "cache": "c"}},
            "data.cache: only diffusion transformers",
        ),
    ]
    bad = tmp_path / "data" / "bad.jsonl"
    bad.write_text(data.read_text() + json.dumps({"caption": "x", "video": "clips/nothing.mp4"}) + "\n")
    cases.append(({"data": {**base["data"], "path": str(bad)}}, f"{bad}:3: video: file or frame folder not found"))
    for change, message in cases:
        code, err = run_main({**base, **change}, tmp_path)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (change, err)


def test_buckets_smaller_than_a_batch_are_reported(capsys: pytest.CaptureFixture) -> None:
    from runtime.train.dit import warn_small_buckets

    warn_small_buckets([Bucket(1, 32, 48)] * 3 + [Bucket(1, 32, 32)], batch_size=2, video=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "warning: data.buckets [32, 32] holds 1 sample(s), fewer than data.batch_size=2: they are never trained on"
    ]
