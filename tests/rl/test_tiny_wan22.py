"""``python -m runtime.tiny pipeline wan_a14b``: a tiny Wan2.2 A14B (two random Wan experts switched at
``boundary_ratio``) that plain ``WanPipeline`` loads with ``transformer_2``; the RL and trainer start-up lines name
the expert a job trains; and ``--overwrite`` refuses, before building anything, an earlier output holding a user's
file anywhere in its tree (a subfolder included), leaving the file where it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.tiny import A14B_BOUNDARY, main


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "a14b"
    assert main(["pipeline", "wan_a14b", str(out)]) == 0
    return out


def test_plain_wan_pipeline_loads_both_experts(a14b: Path) -> None:
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(a14b)
    assert pipe.config.boundary_ratio == A14B_BOUNDARY and pipe.transformer_2 is not None
    first, second = pipe.transformer.state_dict(), pipe.transformer_2.state_dict()
    assert first.keys() == second.keys()
    assert any(not torch.equal(first[k], second[k]) for k in first)  # two experts, not one twice


@pytest.mark.parametrize(
    ("expert", "words"),
    [("transformer", "training expert: transformer (high noise, t >= 875)"),
     ("transformer_2", "training expert: transformer_2 (low noise, t < 875)")],
)  # fmt: skip
def test_start_up_lines_name_the_trained_expert(a14b: Path, tmp_path: Path, expert: str, words: str) -> None:
    from runtime.parallel.state import ParallelState
    from runtime.rl.config import parse_rl_config
    from runtime.train.config import parse_config
    from runtime.train.summary import plan_summary, run_summary
    from tests.rl.common import rl_config

    condition = {"condition": {"expert": expert}}
    rl = parse_rl_config(rl_config("wan", a14b, tmp_path, dit=condition))
    assert plan_summary(rl, ParallelState()).endswith(f"| {words}")  # runtime.rl's first line
    data = {"path": str(tmp_path), "buckets": [[5, 32, 32]]}
    trainer = {"model": {"type": "wan", "path": str(a14b)}, "data": data, "dit": condition}
    assert run_summary(parse_config(trainer), ParallelState()).endswith(f"| {words}")
    one = parse_rl_config(rl_config("wan", a14b, tmp_path))  # no expert named: nothing said (the checks refuse it)
    assert "training expert" not in plan_summary(one, ParallelState())


def test_overwrite_refuses_a_users_file_in_a_subfolder_before_building(
    a14b: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    shutil.copytree(a14b, out)
    (out / "transformer" / "my_notes.txt").write_text("mine")
    monkeypatch.setattr("runtime.tiny.save_wan_a14b", lambda *a: pytest.fail("built before refusing"))
    capsys.readouterr()
    assert main(["pipeline", "wan_a14b", str(out), "--overwrite"]) == 2
    _, err = capsys.readouterr()
    refusal = f"{out} holds files this command does not write (transformer/my_notes.txt); choose another directory"
    assert err == f"error: {refusal}\n"
    assert (out / "transformer" / "my_notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing built beside it


def test_overwrite_refuses_a_tree_without_the_list_of_written_files(
    a14b: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output whose list is gone (or a folder no run of this command wrote) is not known to be ours: refused."""
    out = tmp_path / "out"
    shutil.copytree(a14b, out)
    listed = json.loads((out / ".runtime-tiny.json").read_text())["files"]
    assert "transformer_2/diffusion_pytorch_model.safetensors" in listed and "model_index.json" in listed
    (out / ".runtime-tiny.json").unlink()
    monkeypatch.setattr("runtime.tiny.save_wan_a14b", lambda *a: pytest.fail("built before refusing"))
    assert main(["pipeline", "wan_a14b", str(out), "--overwrite"]) == 2
    assert "holds files this command does not write (model_index.json, " in capsys.readouterr().err
    assert (out / "model_index.json").is_file()
