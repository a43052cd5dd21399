"""User errors of the trainer: each is one line on stderr naming the file (and line or key), exit code 2, and is
found before the model is built (so before any training time is spent and before anything is written).

The CLI runs in this process (``run_main``): importing torch once per case in a subprocess would cost seconds each;
``test_malformed_yaml_exits_2`` in test_trainer.py keeps one real ``python -m runtime.train`` run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.common import run_config, run_main


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


def test_export_dir_never_deletes_what_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_damaged_checkpoint_is_one_line_before_the_model(tmp_path: Path) -> None:
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
