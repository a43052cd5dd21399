"""The omni data pipeline: audio decoding and resampling, the generated processor's patches, chat samples with audio,
images and a video with its audio track -> tokens, labels, mel features and position ids, packing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.data.audio.packing import pack_omni_row
from runtime.data.audio.processor import build_omni_test_processor, load_omni_processor, omni_token_ids
from runtime.data.audio.synthetic import write_synthetic_omni_dataset
from runtime.data.audio.tokenization import tokenize_omni
from runtime.data.audio.waveforms import load_audio, write_audio
from runtime.data.samples import read_jsonl
from runtime.models.registry import lookup
from runtime.models.tiny_configs import tiny_config
from tests.omni.omni import MODEL_TYPE


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("omni_data")
    processor = load_omni_processor(build_omni_test_processor(root / "proc"))
    ids = omni_token_ids(processor)
    config = tiny_config(MODEL_TYPE, **ids, text_config={"vocab_size": 576})
    cls = lookup(MODEL_TYPE).model_class()
    path = write_synthetic_omni_dataset(root / "data", 6)
    return {"root": root, "processor": processor, "config": config, "cls": cls, "path": path, "ids": ids}


def _tokenize(env: dict, samples) -> list:
    fn = env["cls"].get_position_id_func(env["config"])
    return [tokenize_omni(s, env["processor"], fn, env["config"]) for s in samples]


def test_audio_files_decode_to_mono_at_the_extractor_rate(tmp_path: Path) -> None:
    t = np.arange(22050) / 22050
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    write_audio(tmp_path / "a.wav", tone, 22050)
    wave = load_audio(tmp_path / "a.wav", 16000)
    assert wave.dtype == np.float32 and abs(wave.shape[0] - 16000) <= 1  # one second, resampled
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(np.argmax(spectrum) * 16000 / wave.shape[0] - 440) < 2  # still a 440 Hz tone
    import soundfile

    soundfile.write(str(tmp_path / "s.flac"), np.stack([tone, -tone], 1)[:8000], 16000)
    stereo = load_audio(tmp_path / "s.flac", 16000)
    assert stereo.shape == (8000,) and np.abs(stereo).max() < 1e-3  # channels averaged: the two cancel
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    with pytest.raises(ValueError, match=r"cannot read audio .*bad\.wav"):
        load_audio(tmp_path / "bad.wav", 16000)


def test_generated_processor_takes_audios_and_empty_lists(env: dict) -> None:
    processor = env["processor"]
    wave = load_audio(env["path"].parent / "audio/0000_clip.wav", 16000)
    text = "hi <|audio_start|><|audio_pad|><|audio_end|> there"
    ref = processor(text=[text], audio=[wave], return_tensors="pt")
    got = processor(text=[text], audios=[wave], images=[], videos=[], return_tensors="pt")
    assert ref.keys() == got.keys() and "pixel_values" not in got
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    with pytest.raises(TypeError, match="both audio= and audios="):
        processor(text=[text], audio=[wave], audios=[wave])


def test_sample_equals_the_processor_call(env: dict, tmp_path: Path) -> None:
    """An image + audio chat: the pipeline's tokens and media are what the (generated) processor makes of the
    rendered chat, and its labels cover exactly the assistant reply."""
    chat = json.loads(env["path"].read_text().splitlines()[2])  # sample 2: an image and an audio
    sample = read_jsonl(env["path"])[2]
    (got,) = _tokenize(env, [sample])
    processor = env["processor"]
    from PIL import Image

    base = env["path"].parent
    parts = chat["messages"][0]["content"]
    image = Image.open(base / parts[0]["image"]).convert("RGB")
    wave = load_audio(base / parts[1]["audio"], 16000)
    messages = [{"role": m["role"], "content": m["content"]} for m in chat["messages"]]
    text = processor.apply_chat_template(messages, tokenize=False)
    ref = processor(text=[text], images=[image], audios=[wave], return_tensors="pt")
    assert torch.equal(got.input_ids, ref["input_ids"][0])
    for key in ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask"):
        assert torch.equal(getattr(got, key), ref[key]), key
    reply = processor.tokenizer.decode(got.input_ids[got.labels != -100])
    assert reply == chat["messages"][1]["content"] + "<|im_end|>"


def test_position_ids_of_a_video_with_its_track_match_upstream(env: dict) -> None:
    """Sample 3 (a video with its audio track): the tokens interleave video and audio as upstream's get_rope_index
    expects; the generated model fed the pipeline's (4, 1, L) ids equals upstream computing them itself."""
    (sample,) = _tokenize(env, [read_jsonl(env["path"])[3]])
    ids = env["ids"]
    tokens = sample.input_ids.tolist()
    start = tokens.index(ids["vision_start_token_id"])
    assert tokens[start + 1] == ids["audio_start_token_id"]  # the audio-in-video block
    block = tokens[start + 2 : tokens.index(ids["audio_end_token_id"])]
    assert ids["audio_token_id"] in block and ids["video_token_id"] in block
    first_audio = block.index(ids["audio_token_id"])
    assert ids["video_token_id"] in block[first_audio:]  # interleaved, not one run after the other
    row = pack_omni_row([sample], 512)
    torch.manual_seed(0)
    generated = env["cls"](env["config"])
    upstream = lookup(MODEL_TYPE).upstream_class().from_config(env["config"], attn_implementation="sdpa")
    upstream.load_state_dict(generated.state_dict())
    media = {k: v for k, v in row.items() if k not in ("position_ids", "video_second_per_grid")}
    ref = upstream(
        **media,
        attention_mask=torch.ones_like(row["input_ids"]),
        use_audio_in_video=True,
        video_second_per_grid=row["video_second_per_grid"],
    )
    got = generated(**media, position_ids=row["position_ids"])
    assert torch.equal(ref.logits, got.logits)


def test_videos_with_and_without_a_track_in_one_sample_are_an_error(env: dict, tmp_path: Path) -> None:
    base = env["path"].parent
    frames = [str(base / f"videos/0003_f{k}.png") for k in range(4)]
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": frames, "audio": str(base / "audio/0003_track.flac")},
                    {"type": "video", "video": frames},
                ],
            },
            {"role": "assistant", "content": "ok"},
        ]
    }
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="must all have an audio track or none"):
        _tokenize(env, read_jsonl(path, media_dir=base))  # absolute media paths: allowed inside media_dir


def test_packed_row_pads_mel_frames_and_keeps_channels_first_ids(env: dict) -> None:
    samples = _tokenize(env, read_jsonl(env["path"]))
    with_audio = [s for s in samples if s.input_features is not None]
    row = pack_omni_row(samples, 1024)
    length = sum(len(s) for s in samples)
    assert row["position_ids"].shape == (4, 1, length)
    frames = max(s.input_features.shape[-1] for s in with_audio)
    assert row["input_features"].shape == (len(with_audio), 16, frames)
    assert row["feature_attention_mask"].sum().item() == sum(int(s.feature_attention_mask.sum()) for s in with_audio)
    starts = (row["position_ids"][0, 0] == 0).nonzero().flatten().tolist()
    assert len(starts) == len(samples)  # every sample restarts its positions
