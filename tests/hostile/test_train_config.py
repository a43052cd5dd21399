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
    ("train.steps", {"train": {"steps": 0}}, ("positive", "found 0")),
    ("train.micro_batches", {"train": {"micro_batches": -2}}, ("positive",)),
    ("data.token_budget", {"data": {"token_budget": 0}}, ("positive",)),
    ("log.interval", {"log": {"interval": 0}}, ("positive",)),
    ("checkpoint.save_total_limit", {"checkpoint": {"save_total_limit": 0}}, ("positive",)),
    ("checkpoint.interval", {"checkpoint": {"interval": -1}}, ("negative",)),
    ("optim.warmup_steps", {"optim": {"warmup_steps": -1}}, ("negative",)),
    ("optim.max_grad_norm", {"optim": {"max_grad_norm": -1.0}}, ("negative",)),
    ("optim.lr", {"optim": {"lr": -1e-3}}, ("negative",)),
    ("optim.name", {"optim": {"name": "adamw"}}, ("adamw_torch", "did you mean")),
    ("optim.lr_scheduler_type", {"optim": {"lr_scheduler_type": "cosin"}}, ("did you mean 'cosine'",)),
    ("train.mixed_precision", {"train": {"mixed_precision": "fp16"}}, ("auto, bf16, fp32",)),
    ("log.report_to", {"log": {"report_to": ["wandbb"]}}, ("report_to[0]", "did you mean 'wandb'")),
    ("lora.rank", {"lora": {"rank": 0}}, ("positive",)),
    ("lora.alpha", {"lora": {"alpha": -8}}, ("positive",)),
    ("lora.dropout", {"lora": {"dropout": 1.5}}, ("[0, 1]",)),
    ("eval.every_steps", {"eval": {"every_steps": -1}}, ("negative",)),
    ("eval.max_batches", {"eval": {"max_batches": 0}}, ("positive",)),
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
    from runtime.train.config_checks import ATTN_IMPLEMENTATIONS

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


def test_dit_attention_backends_are_those_of_diffusers() -> None:
    """The list the config is checked against without importing diffusers (and torch) is diffusers' own enum."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    from runtime.train.config_checks import DIFFUSERS_ATTENTION_BACKENDS

    assert list(DIFFUSERS_ATTENTION_BACKENDS) == [b.value for b in AttentionBackendName]


def test_dit_validation_and_sampling_numbers_are_range_checked(tmp_path: Path, nothing_built) -> None:
    raw = _dit_config(tmp_path, validation={"prompts": ["a cat"], "num_inference_steps": 0})
    _check(raw, tmp_path, "validation.num_inference_steps", "positive")
    raw = _dit_config(tmp_path, validation={"prompts": ["a cat"], "guidance_scale": -1.0})
    _check(raw, tmp_path, "validation.guidance_scale", "positive")
    _check(_dit_config(tmp_path, dit={"ema_decay": 1.0}), tmp_path, "dit.ema_decay", "(0, 1)")


def test_model_config_keys_read_from_source_are_those_of_the_imported_classes() -> None:
    """For every registered transformers model type, the keys (and sub-configs) read from transformers' source
    without importing it equal those found on the imported config class (``known_config_keys``)."""
    from transformers import CONFIG_MAPPING

    from runtime.models.registry import REGISTRY
    from runtime.train.config_source import static_config_keys
    from runtime.train.model_keys import imported_config_keys

    checked = 0
    for model_type, entry in sorted(REGISTRY.items()):
        if entry.family == "dit":
            assert static_config_keys(model_type) is None  # diffusers models: model.config is refused for DiTs
            continue
        static, imported = static_config_keys(model_type), imported_config_keys(CONFIG_MAPPING[model_type])
        assert static is not None, model_type
        assert (static.name, static.keys) == (imported.name, imported.keys), (model_type, static.keys ^ imported.keys)
        assert static.sub_configs == imported.sub_configs, model_type
        checked += 1
    assert checked >= 8


RENAMED_CASES = [
    ("optim.grad_clip", {"optim": {"grad_clip": 1.0}}, "optim.max_grad_norm"),
    ("checkpoint.keep", {"checkpoint": {"keep": 3}}, "checkpoint.save_total_limit"),
    ("log.tensorboard", {"log": {"tensorboard": True}}, "log.report_to (a list: [tensorboard])"),
]


@pytest.mark.parametrize(("key", "change", "new"), RENAMED_CASES, ids=[c[0] for c in RENAMED_CASES])
def test_old_key_names_are_refused_with_the_new_name(tmp_path: Path, nothing_built, key, change, new) -> None:
    _check(run_config(tmp_path, **change), tmp_path, key, f"renamed to {new}")


def test_old_dit_lora_section_is_refused_with_the_new_one(tmp_path: Path, nothing_built) -> None:
    raw = _dit_config(tmp_path, dit={"lora": {"rank": 4}})
    _check(raw, tmp_path, "dit.lora", "renamed to lora (a top-level section")


def test_every_error_of_a_config_is_one_line_each(tmp_path: Path, nothing_built) -> None:
    """Errors in several sections and inside model.config are all reported, in the order of their lines."""
    raw = run_config(tmp_path, optim={"lr": math.nan, "min_lr_ratio": 2}, train={"stepz": 3})
    raw["model"]["config"].update(hiden_size=64, num_attention_heads=0)
    raw["log"]["tensorbord"] = True
    code, stderr = run_main(raw, tmp_path)
    text = (tmp_path / "run.yaml").read_text()
    lines = stderr.strip().splitlines()
    expected = {
        "model.config.hiden_size": "did you mean 'hidden_size'",
        "model.config.num_attention_heads": "[1, 1048576]",
        "optim.lr": "finite",
        "optim.min_lr_ratio": "[0, 1]",
        "train.stepz": "did you mean train.steps",
        "log.tensorbord": "did you mean log.tensorboard",
    }
    assert code == 2 and len(lines) == len(expected), stderr
    for key, words in expected.items():
        prefix = f"error: {tmp_path / 'run.yaml'}:{_key_line(text, key)}: {key}"
        assert any(line.startswith(prefix) and words in line for line in lines), (key, stderr)
    numbers = [int(line.split(":")[2]) for line in lines]
    assert numbers == sorted(numbers)


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
    _check(run_config(tmp_path, export={"dir": str(blocker)}), tmp_path, "export.dir", str(blocker))
    _check(run_config(tmp_path, export={"dir": str(blocker), "overwrite": True}), tmp_path, "export.dir", str(blocker))
    assert blocker.read_text() == "mine"


# --------------------------------------------------------------------------------------------------- the file itself


def _main(path: Path) -> tuple[int, str]:
    from runtime.train.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(path)])
    return code, err.getvalue()


def test_config_file_that_cannot_be_read_is_one_line(tmp_path: Path, nothing_built) -> None:
    from runtime.config.shape import MAX_CONFIG_DEPTH, MAX_CONFIG_VALUES
    from runtime.config.yaml_file import MAX_CONFIG_BYTES

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
