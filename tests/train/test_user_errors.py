"""User errors of the trainer: each is one line on stderr naming the file (and line or key), exit code 2, and is
found before the model is built (so before any training time is spent and before anything is written).

The CLI runs in this process (``run_main``): importing torch once per case in a subprocess would cost seconds each;
``test_malformed_yaml_exits_2`` in test_trainer.py keeps one real ``python -m runtime.train`` run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train.common import TINY_MODEL, run_config, run_main
from tests.train.vlm_common import vlm_run_config


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The errors of a test using this must be found before the trainer builds its model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the user error was found")

    monkeypatch.setattr("runtime.train.loop.build_model", refuse)


def _one_line_exit_2(code: int, stderr: str, *needles: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_config_errors(tmp_path: Path) -> None:
    cases = [
        (lambda raw: raw["optim"].update(lr="fast"), "optim.lr: expected float, found str 'fast'"),
        (lambda raw: raw["train"].update(stepz=3), "train.stepz: unknown key"),
        (lambda raw: raw.pop("data"), "data: required key missing"),
        (lambda raw: raw.update(parallel={"sp": 3}), "parallel:"),
        (lambda raw: raw["model"].update(type="gpt9"), "model.type: no generated model for model_type 'gpt9'"),
    ]
    for mutate, message in cases:
        raw = run_config(tmp_path)
        mutate(raw)
        _one_line_exit_2(*run_main(raw, tmp_path), message)


def test_export_dir_never_deletes_what_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_model) -> None:
    """A user folder, the checkpoint dir, a folder holding it, the run (log) dir, ``.`` and an unwritable place are
    all refused up front; nothing is trained and every file is still there."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    ckpt = tmp_path / "runs" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "something").write_text("x")
    log = tmp_path / "log"  # run_config's log.dir
    log.mkdir()
    (log / "old-metrics.jsonl").write_text("{}\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "train.yaml").write_text("x")
    monkeypatch.chdir(cwd)

    cases = [
        (user, ("export.dir", str(user), "not an earlier export")),
        (ckpt, ("export.dir", "checkpoint.dir")),
        (ckpt.parent, ("export.dir", "checkpoint.dir")),
        (log, ("export.dir", "log.dir")),
        (".", ("export.dir", "not an earlier export")),
        (blocker / "hf", ("export.dir", "cannot write", str(blocker))),
    ]
    for export_dir, needles in cases:
        raw = run_config(
            tmp_path, checkpoint={"dir": str(ckpt), "interval": 1}, export={"dir": str(export_dir)}, train={"steps": 1}
        )
        code, stderr = run_main(raw, tmp_path)
        _one_line_exit_2(code, stderr, *needles)
    assert (user / "notes.txt").read_text() == "keep me"
    assert (ckpt / "something").is_file() and not any(p.name.startswith("step_") for p in ckpt.iterdir())
    assert sorted(p.name for p in log.iterdir()) == ["old-metrics.jsonl"]  # no run started
    assert sorted(p.name for p in cwd.iterdir()) == ["train.yaml"]


def test_earlier_export_needs_overwrite(tmp_path: Path) -> None:
    """An earlier export (recognised by the marker the exporter writes) is replaced only with export.overwrite."""
    from runtime.checkpoint.export import EXPORT_MARKER

    out = tmp_path / "hf"
    raw = run_config(tmp_path, export={"dir": str(out)}, train={"steps": 1})
    assert run_main(raw, tmp_path)[0] == 0
    assert (out / EXPORT_MARKER).is_file() and (out / "model.safetensors").is_file()
    code, stderr = run_main(raw, tmp_path)
    _one_line_exit_2(code, stderr, "export.dir", "earlier export", "export.overwrite: true")
    raw["export"]["overwrite"] = True
    assert run_main(raw, tmp_path)[0] == 0
    (out / "README.md").write_text("my notes")  # a file the exporter did not write: never deleted
    code, stderr = run_main(raw, tmp_path)
    _one_line_exit_2(code, stderr, "export.dir", "README.md")
    assert (out / "README.md").read_text() == "my notes"


def test_damaged_checkpoint_is_one_line_before_the_model(tmp_path: Path, no_model) -> None:
    """An explicit damaged checkpoint, or a `resume: auto` directory whose checkpoints are all damaged, is exit 2
    naming the checkpoint (the checkpoint's model does not matter: nothing is read before it is verified)."""
    from runtime.checkpoint import save_checkpoint
    from tests.checkpoint.common import mlp
    from tests.checkpoint.test_verify import _distcp, _noise

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, 3, *mlp())
    _noise(_distcp(ckpt / "step_000003"))
    explicit = run_config(tmp_path, checkpoint={"dir": str(tmp_path / "other"), "resume": str(ckpt / "step_000003")})
    _one_line_exit_2(*run_main(explicit, tmp_path), "checkpoint.resume", str(ckpt / "step_000003"), "sha256")
    auto = run_config(tmp_path, checkpoint={"dir": str(ckpt), "resume": "auto"})
    _one_line_exit_2(*run_main(auto, tmp_path), "checkpoint.resume", str(ckpt / "step_000003"), "resume: null")
    missing = run_config(tmp_path, checkpoint={"resume": str(tmp_path / "nope")})
    _one_line_exit_2(*run_main(missing, tmp_path), "checkpoint.resume", str(tmp_path / "nope"))
    assert not (tmp_path / "log").exists()  # nothing started


def _line_of(path: Path, needle: str) -> int:
    return next(k for k, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_config_keys_name_the_yaml_line(tmp_path: Path, no_model) -> None:
    """Unknown model.config keys (checked against the config class, sub-configs included) are errors with the
    closest known key; every key error names the config file and the key's line."""
    cases = [
        (run_config(tmp_path, model={"config": {**TINY_MODEL, "hiden_size": 64}}), "hiden_size", "hidden_size"),
        (run_config(tmp_path, model={"config": {**TINY_MODEL, "rope_thetaa": 1e4}}), "rope_thetaa", "rope_theta"),
        (run_config(tmp_path, model={"path": str(tmp_path)}), "config:", "model.path"),
    ]
    vlm = vlm_run_config(tmp_path)
    vlm["model"]["config"]["text_config"]["num_hiden_layers"] = 1
    cases.append((vlm, "num_hiden_layers", "num_hidden_layers"))
    vlm = vlm_run_config(tmp_path)
    vlm["model"]["config"]["vision_config"]["depht"] = 1
    cases.append((vlm, "depht", "depth"))
    for raw, key, hint in cases:
        code, stderr = run_main(raw, tmp_path)
        yaml_path = tmp_path / "run.yaml"
        line = _line_of(yaml_path, key)
        _one_line_exit_2(code, stderr, f"{yaml_path}:{line}: model.", key, hint)
    raw = run_config(tmp_path)
    raw["optim"]["lr"] = "fast"
    code, stderr = run_main(raw, tmp_path)
    _one_line_exit_2(code, stderr, f"{tmp_path / 'run.yaml'}:{_line_of(tmp_path / 'run.yaml', 'lr: fast')}: optim.lr")


def _corrupt(image: Path) -> None:
    image.write_bytes(image.read_bytes()[:40])  # a PNG header and nothing else


def test_data_errors_name_file_and_line(tmp_path: Path, no_model) -> None:
    """Missing or empty data, bad lines and missing or unreadable images (and a model.path that is no checkpoint):
    one line naming file:line, exit 2, before the model is built."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    cases = [
        (
            run_config(tmp_path, data={"path": str(tmp_path / "nope.jsonl")}),
            (str(tmp_path / "nope.jsonl"), "not found"),
        ),
        (run_config(tmp_path, data={"path": str(empty)}), (str(empty), "no samples")),
        (run_config(tmp_path, data={"path": str(blank)}), (str(blank), "no samples")),
        (run_config(tmp_path, data={"path": str(bad)}), (f"{bad}:2:", "invalid JSON")),
    ]
    vlm = vlm_run_config(tmp_path / "missing")
    data = Path(vlm["data"]["path"])
    image = _images_of_line(data, 3)[0]
    image.unlink()
    cases.append((vlm, (f"{data}:3:", "file not found", str(image))))
    vlm = vlm_run_config(tmp_path / "corrupt")
    data = Path(vlm["data"]["path"])
    image = _images_of_line(data, 2)[1]  # line 2 is a video: its second frame
    _corrupt(image)
    cases.append((vlm, (f"{data}:2:", "cannot read image", str(image))))
    for raw, needles in cases:
        _one_line_exit_2(*run_main(raw, tmp_path), "data.path", *needles)
    no_checkpoint = run_config(tmp_path, model={"path": str(tmp_path)})
    del no_checkpoint["model"]["config"]
    _one_line_exit_2(*run_main(no_checkpoint, tmp_path), "model.path", str(tmp_path), "no config.json")


def _images_of_line(data: Path, lineno: int) -> list[Path]:
    """The image files (images and video frames) a line of the JSONL refers to."""
    record = json.loads(data.read_text().splitlines()[lineno - 1])
    parts = [p for m in record["messages"] if isinstance(m["content"], list) for p in m["content"]]
    files = [[p["image"]] if p["type"] == "image" else p["video"] for p in parts if p["type"] != "text"]
    return [data.parent / name for names in files for name in names]


def test_late_image_decode_failure_names_file_and_line(tmp_path: Path) -> None:
    """Only the first lines' images are opened up front; one that fails to decode later is the same one-line error."""
    from runtime.train.preflight import VERIFIED_IMAGE_LINES

    raw = vlm_run_config(tmp_path, train={"steps": 1})
    data = Path(raw["data"]["path"])
    lines = data.read_text().splitlines()
    late = next(k for k in range(VERIFIED_IMAGE_LINES + 1, len(lines) + 1) if _images_of_line(data, k))
    image = _images_of_line(data, late)[0]
    _corrupt(image)
    _one_line_exit_2(*run_main(raw, tmp_path), "data.path", f"{data}:{late}:", "cannot read image", str(image))


def test_model_path_with_missing_or_unexpected_keys(tmp_path: Path) -> None:
    """A checkpoint whose weights do not match the model is an error naming the keys, not a warning."""
    from safetensors.torch import load_file, save_file

    from runtime.config.errors import ConfigError
    from runtime.models.registry import causal_lm_class
    from runtime.models.tiny_configs import tiny_config
    from runtime.train.config import ModelConfig
    from runtime.train.model import build_model

    causal_lm_class("qwen3")(tiny_config("qwen3")).save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        build_model(ModelConfig(type="qwen3", path=str(tmp_path / "ckpt")))
    message = str(info.value)
    assert "\n" not in message and message.startswith("model.path:")
    assert "missing keys model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected keys model.layers.9.extra.weight" in message

    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ConfigError, match=r"mismatched shapes .*model.layers.0.mlp.down_proj.weight \(64, 96\) vs"):
        build_model(ModelConfig(type="qwen3", path=str(tmp_path / "ckpt")))
