"""Hostile run configurations for ``python -m runtime.train``.

Rule checked by every case here: a bad run config (a non-finite or out-of-range number, an unknown choice, a model
size that cannot be built, an output directory that is a file, a config file that cannot be read) exits with code 2
and prints exactly one line, ``error: <config file>:<line>: <key>: ...`` naming the key's line in the YAML (or
``error: <config file>: ...`` when the file itself is the problem), before any model is built and before anything
is written.

The entry point runs in this process (``tests.train.common.run_main``); no case builds a model.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

import pytest
import yaml

from tests.train.common import TINY_MOE, run_config, run_main


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error of a test using this must be found before the trainer builds its job (model, processor, data)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the job was built before the user error was found")

    monkeypatch.setattr("runtime.train.loop.build_text_job", refuse)
    monkeypatch.setattr("runtime.train.dit.build_dit_job", refuse)


def _key_line(text: str, dotted: str) -> int:
    """The 1-based line of ``dotted``'s last key in the YAML text ``text``, found by reading the text itself."""
    lines, start, found = text.splitlines(), 0, None
    for part in dotted.split("."):
        found = next(k for k in range(start, len(lines)) if lines[k].strip().startswith(f"{part}:"))
        start = found + 1
    return found + 1


def _one_line(code: int, stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr)
    return lines[0]


def _check(raw: dict, tmp_path: Path, key: str, *needles: str) -> None:
    code, stderr = run_main(raw, tmp_path)
    line = _one_line(code, stderr)
    path = tmp_path / "run.yaml"
    expected = f"error: {path}:{_key_line(path.read_text(), key)}: {key}"
    assert line.startswith(expected) and line[len(expected)] in ":[", (expected, line)
    for needle in needles:
        assert needle in line, (needle, line)


def _fake_pipeline(root: Path, model_type: str = "wan", **transformer) -> Path:
    """A directory that passes the pipeline-directory check (the runs here stop before anything is loaded)."""
    from runtime.diffusion.registry import tiny_config

    pipe = root / f"pipe-{model_type}"
    (pipe / "transformer").mkdir(parents=True, exist_ok=True)
    (pipe / "model_index.json").write_text("{}")
    (pipe / "transformer" / "config.json").write_text(json.dumps({**tiny_config(model_type), **transformer}))
    return pipe


def _dit_config(root: Path, **sections) -> dict:
    from runtime.data.dit.synthetic import write_synthetic_images

    data = root / "images" / "data.jsonl"
    if not data.exists():
        data = write_synthetic_images(root / "images", 2, 32, 32, seed=0)
    raw = {
        "model": {"type": "flux", "path": str(_fake_pipeline(root, "flux"))},
        "data": {"path": str(data), "buckets": [[32, 32]]},
        "train": {"steps": 1},
        "log": {"dir": str(root / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


# ---------------------------------------------------------------------------------------------- numbers and choices

NUMBER_CASES = [
    ("optim.lr", {"optim": {"lr": math.inf}}, ("finite", "inf")),
    ("optim.lr", {"optim": {"lr": math.nan}}, ("finite", "nan")),
    ("optim.eps", {"optim": {"eps": math.nan}}, ("finite",)),
    ("optim.weight_decay", {"optim": {"weight_decay": -math.inf}}, ("finite",)),
    ("optim.max_grad_norm", {"optim": {"max_grad_norm": math.inf}}, ("finite",)),
    ("log.peak_tflops", {"log": {"peak_tflops": math.nan}}, ("finite",)),
    ("optim.min_lr_ratio", {"optim": {"min_lr_ratio": 2}}, ("[0, 1]", "2")),
    ("optim.min_lr_ratio", {"optim": {"min_lr_ratio": -0.5}}, ("[0, 1]",)),
    ("optim.eps", {"optim": {"eps": -1e-8}}, ("negative",)),
    ("log.peak_tflops", {"log": {"peak_tflops": 0}}, ("positive",)),
    ("model.seed", {"model": {"seed": 10**30}}, ("2**63",)),
    ("model.seed", {"model": {"seed": -1}}, ("negative",)),
    ("data.seed", {"data": {"seed": -5}}, ("negative",)),
    ("train.steps", {"train": {"steps": 2**64}}, ("2**63",)),
    ("train.nonfinite", {"train": {"nonfinite": "maybe"}}, ("stop, skip",)),
    ("model.attn_implementation", {"model": {"attn_implementation": "spda"}}, ("did you mean 'sdpa'",)),
    ("model.attn_implementation", {"model": {"attn_implementation": "ulysses_sdpa"}}, ("sdpa", "eager")),
    ("model.attn_implementation", {"model": {"attn_implementation": "flash_attention_2"}}, ("flash_attn",)),
]


@pytest.mark.parametrize(("key", "change", "needles"), NUMBER_CASES, ids=[f"{c[0]}-{c[1]}" for c in NUMBER_CASES])
def test_numbers_and_choices_are_range_checked(tmp_path: Path, nothing_built, key, change, needles) -> None:
    raw = run_config(tmp_path, **change)
    _check(raw, tmp_path, key, *needles)


def test_attention_choices_are_those_transformers_registers() -> None:
    """The fixed list (checked without importing transformers' modeling code) is transformers' own on this install:
    every implementation registered for training and nothing it does not know. Read in a fresh interpreter: other
    tests register attention functions of their own in this one."""
    import subprocess
    import sys

    from runtime.sp.ulysses import PREFIX
    from runtime.train.config import ATTN_IMPLEMENTATIONS

    code = "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as f; print(' '.join(f.valid_keys()))"
    keys = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    ours = ("paged|", PREFIX)  # generation-only, and the runtime's SP wrappers (registered when SP first runs)
    registered = {name for name in keys if not name.startswith(ours)}
    assert set(ATTN_IMPLEMENTATIONS) == registered | {"eager"}


def test_moe_experts_implementation_is_a_known_one(tmp_path: Path, nothing_built) -> None:
    raw = run_config(tmp_path, model={"type": "qwen3_moe", "config": TINY_MOE, "experts_implementation": "grouped"})
    _check(raw, tmp_path, "model.experts_implementation", "patchgen_grouped")


def test_numbers_inside_model_config_and_dit_condition_are_finite(tmp_path: Path, nothing_built) -> None:
    raw = run_config(tmp_path)
    raw["model"]["config"]["rms_norm_eps"] = math.nan
    _check(raw, tmp_path, "model.config.rms_norm_eps", "finite")
    raw = run_config(tmp_path)
    raw["model"]["config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": math.inf}
    _check(raw, tmp_path, "model.config.rope_parameters.rope_theta", "finite")
    raw = run_config(tmp_path)
    raw["model"]["config"]["pad_token_id"] = 10**30
    _check(raw, tmp_path, "model.config.pad_token_id", "2**63")
    _check(_dit_config(tmp_path, dit={"condition": {"shift": math.inf}}), tmp_path, "dit.condition.shift", "finite")


def test_dit_attention_backend_is_a_known_one(tmp_path: Path, nothing_built) -> None:
    raw = _dit_config(tmp_path, model={"attn_implementation": "flsh"})
    _check(raw, tmp_path, "model.attn_implementation", "did you mean 'flash'")


# ------------------------------------------------------------------------------------------------- model sizes


SIZE_CASES = [
    ("model.config.num_attention_heads", {"num_attention_heads": 0}, ("[1, 1048576]", "found 0")),
    ("model.config.hidden_size", {"hidden_size": -64}, ("[1, 1048576]",)),
    ("model.config.hidden_size", {"hidden_size": 2**40}, ("[1, 1048576]",)),
    ("model.config.num_hidden_layers", {"num_hidden_layers": 10**9}, ("[1, 1024]", "layer count")),
    ("model.config.num_hidden_layers", {"num_hidden_layers": 0}, ("[1, 1024]",)),
    ("model.config.num_key_value_heads", {"num_key_value_heads": 3}, ("divide", "num_attention_heads")),
    (
        "model.config",
        {"hidden_size": 2**20, "intermediate_size": 2**20, "vocab_size": 2**20, "head_dim": 2**16},
        ("parameters", "fp32", "memory"),
    ),
]


@pytest.mark.parametrize(("key", "change", "needles"), SIZE_CASES, ids=[c[0] + str(c[1])[:30] for c in SIZE_CASES])
def test_model_sizes_are_bounded_before_the_model_is_built(
    tmp_path: Path, nothing_built, key, change, needles
) -> None:
    raw = run_config(tmp_path)
    raw["model"]["config"].update(change)
    _check(raw, tmp_path, key, *needles)


def test_sub_config_sizes_are_bounded(tmp_path: Path, nothing_built) -> None:
    from tests.train.vlm_common import vlm_run_config

    raw = vlm_run_config(tmp_path)
    raw["model"]["config"]["vision_config"]["depth"] = 0
    _check(raw, tmp_path, "model.config.vision_config.depth", "[1, 1024]")
    raw = vlm_run_config(tmp_path)
    raw["model"]["config"]["text_config"]["num_attention_heads"] = -4
    _check(raw, tmp_path, "model.config.text_config.num_attention_heads", "[1, 1048576]")


def test_dit_transformer_layer_count_and_buckets_are_bounded(tmp_path: Path, nothing_built) -> None:
    from runtime.data.dit.buckets import MAX_BUCKET_SIDE, MAX_BUCKETS

    raw = _dit_config(tmp_path)
    _fake_pipeline(tmp_path, "flux", num_layers=10**9)
    code, stderr = run_main(raw, tmp_path)
    line = _one_line(code, stderr)
    assert "model.path: " in line and "transformer/config.json: num_layers" in line and "[1, 1024]" in line, line
    _fake_pipeline(tmp_path, "flux")
    many = [[16 * (1 + k // 64), 16 * (1 + k % 64)] for k in range(MAX_BUCKETS + 1)]
    _check(_dit_config(tmp_path, data={"buckets": many}), tmp_path, "data.buckets", f"at most {MAX_BUCKETS}")
    huge = [[32, 32], [16, MAX_BUCKET_SIDE + 16]]
    _check(_dit_config(tmp_path, data={"buckets": huge}), tmp_path, "data.buckets", str(MAX_BUCKET_SIDE))


# ------------------------------------------------------------------------------------------------ output directories


def test_output_dirs_that_are_files_are_refused_up_front(tmp_path: Path, nothing_built) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    cases = [
        ("log.dir", run_config(tmp_path, log={"dir": str(blocker)})),
        ("checkpoint.dir", run_config(tmp_path, checkpoint={"dir": str(blocker), "interval": 1})),
        ("checkpoint.dir", run_config(tmp_path, checkpoint={"dir": str(blocker / "ckpt"), "interval": 1})),
        ("data.cache", _dit_config(tmp_path, data={"cache": str(blocker / "cache")})),
    ]
    for key, raw in cases:
        _check(raw, tmp_path, key, str(blocker), "not a directory")
    assert blocker.read_text() == "mine"


# --------------------------------------------------------------------------------------------------- the file itself


def _main(path: Path) -> tuple[int, str]:
    from runtime.train.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(path)])
    return code, err.getvalue()


def test_config_file_that_cannot_be_read_is_one_line(tmp_path: Path, nothing_built) -> None:
    from runtime.train.config import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_VALUES

    text = yaml.safe_dump(run_config(tmp_path)).encode()
    bad = tmp_path / "latin1.yaml"
    offset = text.index(b"steps")
    bad.write_bytes(text[:offset] + b"\xe9" + text[offset:])
    line = _one_line(*_main(bad))
    assert line.startswith(f"error: {bad}: ") and "not UTF-8" in line and f"byte {offset}" in line, line

    line = _one_line(*_main(tmp_path))
    assert line.startswith(f"error: {tmp_path}: ") and "not a file" in line, line

    big = tmp_path / "big.yaml"
    big.write_bytes(text + b"#" * MAX_CONFIG_BYTES + b"\n")
    line = _one_line(*_main(big))
    assert line.startswith(f"error: {big}: ") and f"{MAX_CONFIG_BYTES}" in line, line

    for depth in (MAX_CONFIG_DEPTH + 1, 20000):  # past our limit; past Python's recursion limit
        deep = tmp_path / "deep.yaml"
        deep.write_text(text.decode() + "extra: " + "[" * depth + "]" * depth + "\n")
        line = _one_line(*_main(deep))
        assert line.startswith(f"error: {deep}: ") and f"{MAX_CONFIG_DEPTH} levels" in line, line

    bomb = tmp_path / "bomb.yaml"  # nine levels of nine aliases: 9**9 values from a dozen lines
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]" for k in range(1, 10)]
    config = yaml.safe_load(text.decode())
    config["model"]["config"]["rope_parameters"] = "REPLACE"
    body = yaml.safe_dump(config).replace("REPLACE", "*l9")
    bomb.write_text("\n".join(["x-anchors:", *("  " + line for line in levels), body]))
    started = time.perf_counter()
    line = _one_line(*_main(bomb))
    assert line.startswith(f"error: {bomb}: ") and f"{MAX_CONFIG_VALUES} values" in line, line
    assert time.perf_counter() - started < 10
