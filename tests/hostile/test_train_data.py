"""Hostile training data for ``python -m runtime.train``: data files, media paths and audio.

Rule checked by every case here: bad data (a data file of the wrong kind, a line too long or nested too deep, a
media path outside the data file's directory, audio that is truncated, unreadable or too long) exits with code 2
and prints exactly one line, ``error: <config file>:<line>: data.path: <data file>:<line>: ...``, naming the data
file and line (and the media file), before any model is built; no media file outside the allowed directory is
opened. Media paths are relative to the data file's directory and stay inside it (symlinks resolved), unless
``data.media_dir`` names another directory they must stay inside.

The entry point runs in this process (``tests.train.common.run_main``); no case builds a model.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.common import run_config, run_main


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error of a test using this must be found before the trainer builds its job (model, processor, data)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the job was built before the user error was found")

    monkeypatch.setattr("runtime.train.loop.build_text_job", refuse)
    monkeypatch.setattr("runtime.train.dit.build_dit_job", refuse)


def _data_error(raw: dict, root: Path, *needles: str) -> str:
    code, stderr = run_main(raw, root)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr)
    assert "data.path: " in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _chat(*parts: dict) -> str:
    content = [*parts, {"type": "text", "text": "What is it?"}]
    return json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "It."}]})


def _image(path: Path) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), (200, 30, 30)).save(path)
    return path


def _vlm_config(root: Path, lines: list[str], **data) -> dict:
    """A qwen3_vl run on ``root/set/data.jsonl`` holding ``lines`` (the processor is never loaded: the runs here stop
    at the data checks)."""
    from tests.train.vlm_common import vlm_model_config

    path = root / "set" / "data.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return {
        "model": {"type": "qwen3_vl", "config": vlm_model_config("qwen3_vl")},
        "data": {"path": str(path), "processor": str(root / "no-processor"), **data},
        "train": {"steps": 1},
        "log": {"dir": str(root / "log"), "progress": False},
    }


def _omni_config(root: Path, lines: list[str]) -> dict:
    from tests.omni.trainer_common import omni_model_config

    raw = _vlm_config(root, lines)
    raw["model"] = {"type": "qwen3_omni_moe_thinker", "config": omni_model_config()}
    return raw


def _fake_pipeline(root: Path) -> Path:
    from runtime.diffusion.registry import tiny_config

    pipe = root / "pipe"
    (pipe / "transformer").mkdir(parents=True, exist_ok=True)
    (pipe / "model_index.json").write_text("{}")
    (pipe / "transformer" / "config.json").write_text(json.dumps(tiny_config("flux")))
    return pipe


def _dit_config(root: Path, lines: list[str], name: str = "data.jsonl", **data) -> dict:
    path = root / "dit" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return {
        "model": {"type": "flux", "path": str(_fake_pipeline(root))},
        "data": {"path": str(path), "buckets": [[32, 32]], **data},
        "train": {"steps": 1},
        "log": {"dir": str(root / "log"), "progress": False},
    }


# -------------------------------------------------------------------------------------------------- the data file


def test_data_file_suffix_must_be_a_documented_one(tmp_path: Path, nothing_built) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text('{"text": "a line of text"}\n')
    _data_error(run_config(tmp_path, data={"path": str(csv)}), tmp_path, str(csv), ".jsonl", ".txt")
    raw = _dit_config(tmp_path, [json.dumps({"caption": "x", "image": "a.png"})], name="data.txt")
    _data_error(raw, tmp_path, str(tmp_path / "dit" / "data.txt"), ".jsonl")


def test_a_huge_line_is_refused_fast_with_the_limit(tmp_path: Path, nothing_built) -> None:
    from runtime.data.records import MAX_LINE_BYTES

    data = tmp_path / "huge.jsonl"
    with data.open("w") as f:
        f.write(json.dumps({"text": "first"}) + "\n")
        f.write('{"text": "' + "x" * (MAX_LINE_BYTES + 10) + '"}\n')
        f.write('{"text": "' + "y" * (4 * MAX_LINE_BYTES) + '"}\n')
    started = time.perf_counter()
    _data_error(run_config(tmp_path, data={"path": str(data)}), tmp_path, f"{data}:2:", f"{MAX_LINE_BYTES} bytes")
    assert time.perf_counter() - started < 10


def test_deeply_nested_json_is_refused_with_the_limit(tmp_path: Path, nothing_built) -> None:
    from runtime.data.records import MAX_JSON_DEPTH

    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        data = tmp_path / f"deep{depth}.jsonl"
        nested = "[" * depth + "]" * depth
        data.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "x", "meta": ' + nested + "}\n")
        raw = run_config(tmp_path, data={"path": str(data)})
        _data_error(raw, tmp_path, f"{data}:2:", f"{MAX_JSON_DEPTH} levels")
    ok = tmp_path / "ok.jsonl"
    nested = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    ok.write_text('{"text": "x", "meta": ' + nested + "}\n")
    from runtime.data.samples import read_jsonl

    assert len(read_jsonl(ok)) == 1


# ------------------------------------------------------------------------------------------------------ media paths


def test_chat_media_paths_stay_inside_the_data_directory(tmp_path: Path, nothing_built) -> None:
    inside = _image(tmp_path / "set" / "images" / "a.png")
    outside = _image(tmp_path / "outside" / "secret.png")
    link = tmp_path / "set" / "images" / "link.png"
    link.symlink_to(outside)
    (tmp_path / "set" / "escape").symlink_to(tmp_path / "outside", target_is_directory=True)
    (tmp_path / "set" / "loop_a").symlink_to(tmp_path / "set" / "loop_b")
    (tmp_path / "set" / "loop_b").symlink_to(tmp_path / "set" / "loop_a")
    good = _chat({"type": "image", "image": "images/a.png"})
    cases = [
        (_chat({"type": "image", "image": str(outside)}), ("absolute", str(outside), "data.media_dir")),
        (_chat({"type": "image", "image": str(inside)}), ("absolute",)),
        (_chat({"type": "image", "image": "../outside/secret.png"}), ("../outside/secret.png", "outside")),
        (_chat({"type": "video", "video": ["images/a.png", "images/link.png"]}), ("video[1]", "images/link.png")),
        (_chat({"type": "image", "image": "escape/secret.png"}), ("escape/secret.png", "outside")),
        (_chat({"type": "image", "image": "loop_a"}), ("loop_a", "cannot resolve")),
    ]
    data = tmp_path / "set" / "data.jsonl"
    for line, needles in cases:
        _data_error(_vlm_config(tmp_path, [good, line]), tmp_path, f"{data}:2:", *needles)


def test_omni_audio_paths_stay_inside_the_data_directory(tmp_path: Path, nothing_built) -> None:
    from runtime.data.audio.waveforms import write_audio

    (tmp_path / "elsewhere").mkdir()
    outside = write_audio(tmp_path / "elsewhere" / "a.wav", np.zeros(1600, np.float32), 16000)
    frame = _image(tmp_path / "set" / "f0.png")
    cases = [
        (_chat({"type": "audio", "audio": str(outside)}), "absolute"),
        (_chat({"type": "video", "video": [frame.name], "audio": "../elsewhere/a.wav"}), "outside"),
    ]
    data = tmp_path / "set" / "data.jsonl"
    for line, needle in cases:
        _data_error(_omni_config(tmp_path, [line]), tmp_path, f"{data}:1:", needle)


def test_media_dir_opts_in_to_another_directory(tmp_path: Path) -> None:
    """With ``data.media_dir`` paths resolve against it, absolute ones are allowed, and all must stay inside it."""
    from runtime.train.config import parse_config
    from runtime.train.preflight import check_data

    outside = _image(tmp_path / "outside" / "secret.png")
    _image(tmp_path / "outside" / "b.png")
    lines = [_chat({"type": "image", "image": str(outside)}), _chat({"type": "image", "image": "b.png"})]
    raw = _vlm_config(tmp_path, lines, media_dir=str(tmp_path / "outside"))
    samples = check_data(parse_config(raw))
    assert [s.sample.messages[0].content[0].path for s in samples] == [outside, tmp_path / "outside" / "b.png"]
    raw = _vlm_config(
        tmp_path, [_chat({"type": "image", "image": "../set/data.jsonl"})], media_dir=str(outside.parent)
    )
    _data_error(raw, tmp_path, f"{tmp_path / 'set' / 'data.jsonl'}:1:", "outside")
    raw = _vlm_config(tmp_path, lines, media_dir=str(tmp_path / "nowhere"))
    code, stderr = run_main(raw, tmp_path)
    assert code == 2 and "data.media_dir: " in stderr and "not a directory" in stderr, stderr


def test_text_models_refuse_media_dir(tmp_path: Path, nothing_built) -> None:
    code, stderr = run_main(run_config(tmp_path, data={"media_dir": str(tmp_path)}), tmp_path)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "data.media_dir: " in stderr, stderr


def test_dit_media_paths_stay_inside_the_data_directory(tmp_path: Path, nothing_built) -> None:
    outside = _image(tmp_path / "outside" / "secret.png")
    _image(tmp_path / "dit" / "a.png")
    folder = tmp_path / "dit" / "frames"
    _image(folder / "f0.png")
    (folder / "f1.png").symlink_to(outside)
    (tmp_path / "dit" / "out").symlink_to(tmp_path / "outside", target_is_directory=True)
    good = json.dumps({"caption": "fine", "image": "a.png"})
    cases = [
        (json.dumps({"caption": "x", "image": str(outside)}), ("absolute",)),
        (json.dumps({"caption": "x", "image": "../outside/secret.png"}), ("outside",)),
        (json.dumps({"caption": "x", "video": ["a.png", "out/secret.png"]}), ("video[1]", "outside")),
        (json.dumps({"caption": "x", "video": "frames"}), ("frames/f1.png", "outside")),
        (json.dumps({"caption": "x", "video": "out"}), ("'out'", "outside")),
    ]
    data = tmp_path / "dit" / "data.jsonl"
    for line, needles in cases:
        _data_error(_dit_config(tmp_path, [good, line]), tmp_path, f"{data}:2:", *needles)


# ------------------------------------------------------------------------------------------------------------ audio


def _wav(path: Path, seconds: float, rate: int = 16000) -> Path:
    from runtime.data.audio.waveforms import write_audio

    path.parent.mkdir(parents=True, exist_ok=True)

    wave = np.sin(np.arange(int(seconds * rate)) * 0.05).astype(np.float32) * 0.3
    return write_audio(path, wave, rate)


def test_truncated_or_too_long_audio_is_refused_up_front(tmp_path: Path, nothing_built) -> None:
    from runtime.data.audio.waveforms import MAX_AUDIO_SECONDS

    folder = tmp_path / "set"
    half_wav = folder / "half.wav"
    full = _wav(folder / "full.wav", 1.0).read_bytes()
    half_wav.write_bytes(full[: len(full) // 2])
    header_only = folder / "header.flac"
    header_only.write_bytes(_wav(folder / "full.flac", 1.0).read_bytes()[:30])
    from runtime.data.audio.waveforms import write_audio

    long = write_audio(folder / "long.wav", np.zeros(MAX_AUDIO_SECONDS + 5, np.float32), 1)  # 1 Hz: a small file
    data = folder / "data.jsonl"
    cases = [
        (half_wav, ("truncated",)),
        (header_only, ("cannot read audio",)),
        (long, (f"{MAX_AUDIO_SECONDS} s",)),
    ]
    for audio, needles in cases:
        raw = _omni_config(tmp_path, [_chat({"type": "audio", "audio": audio.name})])
        _data_error(raw, tmp_path, f"{data}:1:", str(audio), *needles)


def test_load_audio_refuses_truncated_and_enormous_audio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The late decode (samples past the first few are decoded when the data is tokenized) applies the same rules,
    and a FLAC stream cut mid-way (its header names more frames than decode) is truncated too."""
    import runtime.data.audio.waveforms as audio

    flac = _wav(tmp_path / "a.flac", 2.0).read_bytes()
    cut = tmp_path / "cut.flac"
    cut.write_bytes(flac[: len(flac) * 2 // 3])
    with pytest.raises(ValueError, match=f"audio {cut}: .*truncated|cannot read audio {cut}"):
        audio.load_audio(cut, 16000)
    ogg = tmp_path / "a.ogg"
    audio.write_audio(ogg, np.sin(np.arange(48000) * 0.05).astype(np.float32), 16000)
    cut_ogg = tmp_path / "cut.ogg"
    stream = ogg.read_bytes()
    cut_ogg.write_bytes(stream[: stream.rindex(b"OggS")])  # whole pages, the last one (end-of-stream) left out
    with pytest.raises(ValueError, match=f"audio {cut_ogg}: truncated"):
        audio.load_audio(cut_ogg, 16000)
    ok = _wav(tmp_path / "ok.wav", 0.5)
    assert audio.load_audio(ok, 16000).shape == (8000,)
    monkeypatch.setattr(audio, "MAX_AUDIO_SAMPLES", 4000)
    with pytest.raises(ValueError, match=f"audio {ok}: 8000 samples .* more than the limit of 4000"):
        audio.load_audio(ok, 16000)


def test_unreadable_symlinked_data_is_never_opened(tmp_path: Path, nothing_built) -> None:
    """A media symlink that points outside is refused before anything reads it (here: a FIFO, which would block)."""
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "x.png").symlink_to(fifo)
    _data_error(_vlm_config(tmp_path, [_chat({"type": "image", "image": "x.png"})]), tmp_path, "outside")
