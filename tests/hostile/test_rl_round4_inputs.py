"""Hostile inputs of the run commands (round 4): sampling sizes, images too large for PIL, a checkpoint whose DCP
metadata is a foreign pickle.

Rules checked here: an RL config's ``sampling`` sizes beyond the limits (those of the DiT trainer's buckets) are one
line each, all at once, before anything is built; an image over PIL's decompression-bomb limit is the project's
one-line error naming the file wherever an image is read (training data, DPO pairs), and PIL's warning is not
printed; a refused ``.metadata`` pickle is one line, without torch's logged tracebacks before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import warnings
from pathlib import Path

import pytest
import yaml

from runtime.config.errors import ConfigError

# ---------------------------------------------------------------------------------------------------- sampling


def _rl_config(tmp_path: Path, model: str, **sampling) -> Path:
    from tests.rl.common import rl_config

    raw = rl_config(model, tmp_path / "no-pipeline", tmp_path, sampling=sampling)
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _line(path: Path, key: str) -> int:
    return next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith(f"{key}:"))


@pytest.fixture
def nothing_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(config):
        raise AssertionError("the run started")

    monkeypatch.setattr("runtime.rl.__main__.run", refuse)


def test_huge_sampling_sizes_are_one_line_each(tmp_path: Path, nothing_run, capsys) -> None:
    from runtime.rl.__main__ import main

    path = _rl_config(tmp_path, "flux", height=65536, width=65536)
    capsys.readouterr()
    assert main([str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: {path}:{_line(path, 'height')}: sampling.height: 65536: more than 16384 pixels (the limit)",
        f"error: {path}:{_line(path, 'width')}: sampling.width: 65536: more than 16384 pixels (the limit)",
    ], lines


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ({"height": 16384, "width": 16384, "frames": 9}, "sampling: 9 x 16384 x 16384 pixels per sample, more than"),
        ({"height": 64, "width": 64, "frames": 4097}, "sampling.frames: 4097: more than 1024 frames (the limit)"),
    ],
)
def test_video_sampling_limits(tmp_path: Path, nothing_run, capsys, sampling, words) -> None:
    from runtime.rl.__main__ import main

    path = _rl_config(tmp_path, "wan", **sampling)
    capsys.readouterr()
    assert main([str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and str(path) in lines[0], lines


def test_sampling_limits_keep_real_sizes(tmp_path: Path) -> None:
    from runtime.rl.config import load_rl_config

    load_rl_config(_rl_config(tmp_path, "wan", height=720, width=1280, frames=81))


# ---------------------------------------------------------------------------------------------------- images


@pytest.fixture
def small_pil_limit(monkeypatch: pytest.MonkeyPatch) -> int:
    """PIL's decompression-bomb limit lowered so that a 40 x 40 image is over it (and under twice it: PIL warns
    then, and raises only above twice the limit)."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    return 1000


def _image(path: Path, size: int = 40) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (10, 200, 30)).save(path)
    return path


def _no_bomb_warning(call) -> Exception:
    """``call()`` must raise; no PIL warning may be emitted on the way."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(Exception) as err:
            call()
    from PIL import Image

    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)], seen
    assert "\n" not in str(err.value), err.value
    return err.value


@pytest.mark.parametrize("size", [40, 50], ids=["warned-by-pil", "refused-by-pil"])
def test_images_over_the_pil_limit_are_one_error(tmp_path: Path, small_pil_limit, size: int) -> None:
    from runtime.data.dit.manifest import MediaSample
    from runtime.data.dit.media import load_frames, probe
    from runtime.data.vision.tokenization import load_image
    from runtime.rl.pairs import read_pairs
    from runtime.train.preflight import verify_image

    big = _image(tmp_path / "big.png", size)
    _image(tmp_path / "small.png", 20)
    sample = MediaSample("data.jsonl:1", "a cat", "image", (big,))
    for call in (
        lambda: verify_image(big, "data.jsonl:1"),
        lambda: load_image(big),
        lambda: probe(sample),
        lambda: load_frames(sample, 1),
    ):
        error = _no_bomb_warning(call)
        assert str(big) in str(error) and "pixels" in str(error), error
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a cat", "chosen": "big.png", "rejected": "small.png"}) + "\n")
    error = _no_bomb_warning(lambda: read_pairs(pairs))
    assert f"{pairs}:1" in str(error) and "big.png" in str(error) and "pixels" in str(error), error


def test_pair_image_grown_after_the_check_is_one_error(tmp_path: Path, small_pil_limit) -> None:
    """The later decode (``encode_media``'s reader) refuses it the same way."""
    from runtime.rl.pairs import _frames

    big = _image(tmp_path / "big.png")
    error = _no_bomb_warning(lambda: _frames(big, "pairs.jsonl:1", None))
    assert isinstance(error, ConfigError) and str(big) in str(error), error


def test_images_under_the_limit_still_read(tmp_path: Path) -> None:
    from runtime.data.vision.tokenization import load_image

    assert load_image(_image(tmp_path / "ok.png")).size == (40, 40)


# ------------------------------------------------------------------------------------------------ checkpoints


def test_refused_metadata_pickle_logs_no_traceback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A .metadata that would call a function when unpickled (its hash recomputed in the marker): refused in one
    line, and torch's DCP logs nothing before it (it logged two tracebacks, a FileNotFoundError among them)."""
    from runtime.checkpoint import COMPLETE_MARKER
    from runtime.checkpoint.dcp import load_checkpoint, save_checkpoint
    from runtime.checkpoint.verify import CheckpointError
    from tests.checkpoint.test_verify import mlp

    path = save_checkpoint(tmp_path, 1, *mlp())
    (path / ".metadata").write_bytes(pickle.dumps(os.getcwd))
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    data = (path / ".metadata").read_bytes()
    marker["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    caplog.set_level(logging.INFO)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, *mlp())
    assert "\n" not in str(err.value) and "posix.getcwd is not allowed" in str(err.value), err.value
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not logged, [(r.name, r.getMessage()) for r in logged]


def test_missing_metadata_is_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runtime.checkpoint import COMPLETE_MARKER
    from runtime.checkpoint.dcp import load_checkpoint, save_checkpoint
    from runtime.checkpoint.verify import CheckpointError
    from tests.checkpoint.test_verify import mlp

    path = save_checkpoint(tmp_path, 1, *mlp())
    (path / ".metadata").unlink()
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    del marker["files"][".metadata"]
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    caplog.set_level(logging.INFO)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, *mlp())
    assert "\n" not in str(err.value) and ".metadata" in str(err.value), err.value
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
