"""``python -m runtime.tiny``: tiny tokenizers, processors and DiT pipelines that plain transformers/diffusers load and
the trainer trains from; one-line refusals with exit code 2; and a DiT run whose stderr has no torchvision notice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from runtime.tiny import main
from tests.train.common import run_config, run_main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _cli(*args: str, module: str = "runtime.tiny", timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """``main(argv)`` exits 2 with one stderr line and nothing on stdout; returns that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, (code, out, err)
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_help_answers_fast() -> None:
    for args in ([], ["tokenizer"], ["processor"], ["pipeline"]):
        start = time.perf_counter()
        done = _cli(*args, "--help")
        assert done.returncode == 0 and done.stdout.startswith("usage: python -m runtime.tiny"), done.stderr
        assert time.perf_counter() - start < 5  # no torch, transformers or diffusers import behind --help
    assert "qwen2_5_vl" in _cli("processor", "--help").stdout and "flux" in _cli("pipeline", "--help").stdout


def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert "invalid choice: 'tokeniser'" in _refused(capsys, ["tokeniser", str(tmp_path / "a")])
    assert "required: directory" in _refused(capsys, ["tokenizer"])
    assert "--vocab-size: 10 is outside" in _refused(capsys, ["tokenizer", str(tmp_path / "a"), "--vocab-size", "10"])
    assert "'qwen3' has no processor; known: qwen2_5_vl" in _refused(capsys, ["processor", "qwen3", str(tmp_path)])
    assert "unknown tiny pipeline 'flx'; known: " in _refused(capsys, ["pipeline", "flx", str(tmp_path / "p")])
    (tmp_path / "file").write_text("mine")
    assert "is not a directory" in _refused(capsys, ["tokenizer", str(tmp_path / "file")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "is not empty; pass --overwrite" in _refused(capsys, ["tokenizer", str(tmp_path / "full")])
    err = _refused(capsys, ["tokenizer", str(tmp_path / "full"), "--overwrite"])
    assert "holds files this command does not write (notes.txt)" in err
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]  # no temporary directory left behind
    assert main(["pipeline", "nope", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err == "error: unknown tiny pipeline 'nope'; known: " + ", ".join(_cases()) + "\n"


def _cases() -> list[str]:
    from runtime.diffusion.registry import tiny_cases

    return sorted([*tiny_cases(), "wan_a14b"])  # the specs' cases and Wan2.2 A14B's two experts (runtime/tiny.py)


def test_tokenizer_loads_in_transformers_and_trains(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    from runtime.data.text.corpus import corpus_path

    out = tmp_path / "tok"
    assert main(["tokenizer", str(out)]) == 0
    assert f"set data.tokenizer: {out}" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = corpus_path().read_text(encoding="utf-8")[:2000]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: any text round-trips
    assert len(tokenizer) == 512 and tokenizer.eos_token == "<|endoftext|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    # an earlier output is replaced on request, and only then
    assert main(["tokenizer", str(out), "--vocab-size", "400", "--overwrite"]) == 0
    assert len(AutoTokenizer.from_pretrained(out)) == 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    capsys.readouterr()

    raw = run_config(tmp_path, data={"tokenizer": str(out)}, train={"steps": 1})
    code, err = run_main(raw, tmp_path)
    assert code == 0, err
    assert (tmp_path / "log" / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_omni_moe_thinker"])
def test_processor_loads_in_transformers(tmp_path: Path, model_type: str) -> None:
    import json

    import transformers

    from runtime.models.tiny_configs import tiny_config_dict

    out = tmp_path / "proc"
    assert main(["processor", model_type, str(out)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for token in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id, token
    image = transformers.Qwen2VLImageProcessorPil.from_pretrained(out)
    tiny = tiny_config_dict(model_type)["vision_config"]  # the tiny model the processor is meant for
    assert (image.patch_size, image.merge_size) == (tiny["patch_size"], tiny["spatial_merge_size"])
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))  # no model files
    if model_type == "qwen3_omni_moe_thinker":
        features = transformers.WhisperFeatureExtractor.from_pretrained(out)
        assert features.sampling_rate == 16000 and tokenizer.audio_token == "<|audio_pad|>"
    else:
        assert json.loads((out / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"


def _dit_run(tmp_path: Path, pipeline: Path) -> Path:
    from runtime.data.dit.synthetic import write_synthetic_images

    images = write_synthetic_images(tmp_path / "images", 2, 32, 32, seed=1)
    raw = {
        "model": {"type": "flux", "path": str(pipeline), "seed": 0},
        "data": {"path": str(images), "buckets": [[32, 32]], "cache": str(tmp_path / "cache")},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"steps": 1},
        "log": {"dir": str(tmp_path / "log"), "progress": False},
    }
    path = tmp_path / "flux.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_pipeline_loads_in_diffusers_and_a_dit_run_prints_no_torchvision_notice(tmp_path: Path) -> None:
    import diffusers

    assert main(["pipeline", "flux", str(tmp_path / "flux")]) == 0
    pipe = diffusers.FluxPipeline.from_pretrained(tmp_path / "flux")
    assert type(pipe.transformer).__module__.startswith("diffusers.")  # the plain diffusers class

    done = _cli(str(_dit_run(tmp_path, tmp_path / "flux")), module="runtime.train", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "torchvision" not in done.stderr and "ImageProcessorPil" not in done.stderr, done.stderr


def test_diffusers_alone_still_prints_the_notice() -> None:
    """The control: the notice the runtime drops is there when diffusers' Flux pipeline is imported without it."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or PyPI's CUDA build that does not import beside the CPU torch
        pass
    else:
        pytest.skip("torchvision imports here: transformers has no fallback to announce")
    code = "import diffusers; diffusers.FluxPipeline"
    done = subprocess.run([sys.executable, "-c", code], cwd="/", env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "`CLIPImageProcessor` requires torchvision (not installed)" in done.stderr


def test_clip_loads_as_a_reward(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`python -m runtime.tiny clip DIR` writes a CLIP checkpoint that transformers loads and an RL `clip` reward
    scores with."""
    import torch
    from transformers import CLIPModel

    from runtime.rl.rewards import build_rewards

    assert main(["clip", str(tmp_path / "clip")]) == 0
    assert f"rewards: [{{clip: {tmp_path / 'clip'}}}]" in capsys.readouterr().out
    assert isinstance(CLIPModel.from_pretrained(tmp_path / "clip"), CLIPModel)
    mix = build_rewards([{"clip": str(tmp_path / "clip")}])
    combined, _ = mix(torch.rand(2, 3, 32, 32), ["a red circle", "a blue square"])
    assert combined.shape == (2,) and torch.isfinite(combined).all()


def test_config_prints_a_model_section_a_tiny_vlm_trains_with(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`python -m runtime.tiny config qwen2_5_vl` prints the `model:` section at the spec's tiny size, its vocabulary
    sized for the tiny processor; pasted into a run config beside that processor and a data file, one step trains
    (no warning about token ids outside the vocabulary: the media ids come from the processor)."""
    import yaml

    from runtime.data.vision.synthetic import write_synthetic_vlm_dataset
    from runtime.parallel.state import set_parallel_state
    from runtime.train.__main__ import main as train

    assert main(["config", "qwen2_5_vl"]) == 0
    section = yaml.safe_load(capsys.readouterr().out)
    assert section["model"]["type"] == "qwen2_5_vl" and section["model"]["config"]["text_config"]["vocab_size"] == 512
    assert main(["processor", "qwen2_5_vl", str(tmp_path / "proc")]) == 0
    data = write_synthetic_vlm_dataset(tmp_path / "data", 8, seed=0)
    raw = {
        **section,
        "data": {"path": str(data), "processor": str(tmp_path / "proc")},
        "train": {"steps": 1},
        "log": {"dir": str(tmp_path / "log"), "progress": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    try:
        assert train([str(tmp_path / "run.yaml")]) == 0
    finally:
        set_parallel_state(None)
    out, err = capsys.readouterr()
    assert "step     1/1 loss" in out and "token_id must be" not in err, (out, err)
    assert main(["config", "wan"]) == 2 and "has no tiny run config" in capsys.readouterr().err
