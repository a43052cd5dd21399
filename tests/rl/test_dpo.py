"""Diffusion-DPO on the shared job (``runtime/rl/algorithms/dpo.py``, ``runtime/rl/offline.py``,
``runtime/rl/pairs.py``). The objective and its gradient against the paper's formula are in
``test_algorithms_nft_dpo.py``; here: the pair file's and the config's user errors, the first step against the
reference it starts equal to (``-log sigmoid(0) = log 2``), a tiny Flux LoRA run that checkpoints, resumes bitwise
and exports a LoRA the plain pipeline loads, SP=2 and FSDP ws=2 against one process, and a 1-D Gaussian flow that
DPO moves toward the chosen side."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.rl.common import rl_config


def _image(path: Path, seed: int, size: tuple[int, int] = (40, 36), flat: bool = False) -> str:
    """Random pixels, or (``flat``) one random colour: two images the model's errors differ on."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (1, 1, 3) if flat else (size[1], size[0], 3)
    pixels = np.broadcast_to(rng.integers(0, 256, shape, dtype=np.uint8), (size[1], size[0], 3))
    Image.fromarray(np.ascontiguousarray(pixels)).save(path)
    return path.name


def write_pairs(directory: Path, count: int = 4) -> Path:
    """``count`` pairs of random PNG / JPEG images (sizes other than the run's: resized and cropped)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        chosen = _image(directory / f"w{i}.png", 2 * i)
        rejected = _image(directory / f"l{i}.jpg", 2 * i + 1, (52, 30), flat=True)
        lines.append(json.dumps({"prompt": f"a picture number {i}", "chosen": chosen, "rejected": rejected}))
    path = directory / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def dpo_raw(tiny_pipelines, tmp_path: Path, **dpo) -> dict:
    """A 2-step Flux LoRA DPO run on 4 pairs, 2 per iteration."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, optim={"lr": 1e-2})
    for key in ("flowgrpo", "rewards"):
        raw.pop(key)
    raw["data"] = {"pairs": str(write_pairs(tmp_path / "pairs")), "prompts_per_step": 2}
    return {**raw, "algorithm": "dpo", "dpo": {"beta": 500.0, **dpo}}


def _error(raw: dict) -> str:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    with pytest.raises(ConfigError) as info:
        parse_rl_config(raw)
    return str(info.value)


def test_config_errors_name_the_key(tiny_pipelines, tmp_path: Path) -> None:
    raw = dpo_raw(tiny_pipelines, tmp_path)
    prompts = {**raw, "data": {"prompts": "p.txt"}}
    assert "data.prompts: dpo trains on offline preference pairs, not prompts; give data.pairs" in _error(prompts)
    assert "rewards: dpo learns from preference pairs" in _error({**raw, "rewards": [{"callable": "m:f"}]})
    assert "reference: lora_disabled needs a LoRA run" in _error({**raw, "lora": {"rank": None}})
    assert "dpo.t_max: expected t_min < t_max" in _error({**raw, "dpo": {"t_min": 0.6, "t_max": 0.5}})
    online = rl_config("flux", tiny_pipelines("flux"), tmp_path)
    online["data"] = {**online["data"], "pairs": raw["data"]["pairs"]}
    assert "data.pairs: preference pairs are dpo's data; flowgrpo samples data.prompts" in _error(online)


def test_cli_user_errors_are_one_line_and_exit_2(tiny_pipelines, tmp_path: Path, capsys) -> None:
    """Through ``python -m runtime.rl``: a bad pair line (before the model is built), a config with the online
    algorithms' ``data.prompts``, and the job's guards on an update that moves nothing (lr 1e-30) and on a
    non-finite gradient, each one line with the file (and line), exit code 2, no traceback."""
    from tests.rl.test_cli import _run

    raw = dpo_raw(tiny_pipelines, tmp_path)
    pairs = Path(raw["data"]["pairs"])
    good = pairs.read_text()
    pairs.write_text(good + '{"prompt": "a", "chosen": "w0.png", "rejected": "gone.png"}\n')
    for update, words in (
        ({}, f"{pairs}:5: \"rejected\": 'gone.png': no such file"),
        ({"data": {"prompts": "p.txt"}}, "data.prompts: dpo trains on offline preference pairs"),
        ({"optim": {"lr": 1e-30}}, "changed no trainable parameter"),
        ({"dpo": {"beta": 1e39}}, "not finite (NaN or inf)"),  # beta beyond float32: an infinite gradient
    ):
        if update and "data" not in update:  # the runs that reach training read the good pairs
            pairs.write_text(good)
        code, _, err = _run(tmp_path, {**raw, **update}, capsys)
        assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert "data" not in update or "rl.yaml:" in err, err  # the config's file and line


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "a", "chosen": "w0.png"}', '"rejected": expected an image path'),
        ('{"prompt": "", "chosen": "w0.png", "rejected": "l0.jpg"}', '"prompt": expected a non-empty string'),
        ('{"prompt": "a", "chosen": "w0.png", "rejected": "nope.png"}', "\"rejected\": 'nope.png': no such file"),
        ('{"prompt": "a", "chosen": "w0.png", "rejected": "../x.png"}', "leads outside"),
        ('{"prompt": "a", "chosen": "w0.png", "rejected": "w0.png"}', "the same file"),
        ('{"prompt": "a", "chosen": "w0.png", "rejected": "bad.png"}', "cannot read image 'bad.png'"),
        ('{"prompt": "a", "chosen": "w0.png", "rejected": "l0.jpg", "score": 1}', "unknown key 'score'"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_a_bad_pair_line_is_one_error_naming_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    from runtime.rl.pairs import read_pairs

    path = write_pairs(tmp_path, 1)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:2: ") as info:
        read_pairs(path)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_first_step_starts_at_the_reference_and_trains(tiny_pipelines, tmp_path: Path) -> None:
    """At step 1 the LoRA policy equals its LoRA-disabled reference (B = 0), so ``d = 0`` for every pair: the loss is
    ``log 2`` and no pair is yet preferred; the update moves the policy, and at step 2 the errors differ from the
    reference's. Same with a frozen copy as the reference."""
    from runtime.rl.loop import iteration
    from tests.rl.common import start, trainable_state

    for reference in ("lora_disabled", "frozen_copy"):
        run, _ = start({**dpo_raw(tiny_pipelines, tmp_path / reference), "reference": reference})
        assert (run.policy.reference is None) == (reference == "lora_disabled")
        before = trainable_state(run.policy)
        first, _ = iteration(run, 1)
        assert first["policy_loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert first["implicit_reward_accuracy"] == 0.0 and first["implicit_reward_margin"] == pytest.approx(0.0)
        assert first["error_chosen"] == pytest.approx(first["error_chosen_ref"], rel=1e-6)
        after = trainable_state(run.policy)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        second, _ = iteration(run, 2)
        assert second["error_chosen"] != second["error_chosen_ref"] and math.isfinite(second["policy_loss"])


def test_resume_is_bitwise_and_the_export_loads(tiny_pipelines, tmp_path: Path) -> None:
    """4 steps in one run == 2 steps, a checkpoint, then 2 more resumed from it (metrics and every trainable
    parameter bitwise: the sampler's position and the draws are checkpointed / functions of the step); the LoRA export
    loads into the plain diffusers pipeline and reproduces the trained transformer."""
    from runtime.checkpoint.diffusers_export import pipeline_class
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl
    from runtime.rl.metrics import TIMING_KEYS
    from tests.rl.common import trainable_state
    from tests.rl.test_job import _probe

    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    raw = dpo_raw(tiny_pipelines, tmp_path, micro_batch_size=1)
    raw = {**raw, "train": {"steps": 4}, "checkpoint": {"dir": str(ckpt), "interval": 2}}
    whole = run_rl(parse_rl_config({**raw, "export": {"dir": str(export)}}))
    log_dir = Path(raw["log"]["dir"])  # an offline run scores nothing: its plot is the loss and reward accuracy
    assert (log_dir / "loss.png").is_file() and not (log_dir / "reward_loss.png").exists()
    again = {**raw, "checkpoint": {**raw["checkpoint"], "resume": str(ckpt / "step_000002")}}
    resumed = run_rl(parse_rl_config(again))
    assert resumed.start_step == 2 and len(resumed.metrics) == 2
    strip = [
        [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in r] for r in (whole.metrics[2:], resumed.metrics)
    ]
    assert strip[0] == strip[1]
    a, b = trainable_state(whole.policy), trainable_state(resumed.policy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    path = tiny_pipelines("flux")
    pipe = pipeline_class(path).from_pretrained(path)
    base = _probe("flux", pipe.transformer)
    pipe.load_lora_weights(export)
    got, expected = _probe("flux", pipe.transformer), _probe("flux", whole.policy.module.eval())
    assert torch.equal(got, expected) and not torch.equal(base, expected)


def dpo_iteration(rank: int, world_size: int, raw: dict) -> dict:
    """Iteration 1 of ``raw`` on this rank: its metrics and the full gradients of its update."""
    from runtime.parallel.state import set_parallel_state
    from runtime.rl.loop import iteration
    from tests.rl.common import record_gradients, start

    with torch.random.fork_rng(devices=[]):
        try:
            run, _ = start(raw)
            grads = record_gradients(run)
            metrics, _ = iteration(run, 1)
            return {"metrics": metrics, "grads": grads[0]}
        finally:
            set_parallel_state(None)


def _full(tiny_pipelines, tmp_path: Path, micro_batch_size: int) -> dict:
    """Full fine-tuning against a frozen copy (every weight's gradient compared), 2 pairs per replica."""
    raw = dpo_raw(tiny_pipelines, tmp_path, beta=50.0, micro_batch_size=micro_batch_size)
    return {**raw, "lora": {"rank": None}, "reference": "frozen_copy"}


def _compare(got: dict, ref: dict, witness: dict, weak: tuple[tuple[str, str], ...] = ()) -> None:
    """Every gradient and the metrics under the rounding model (``tests.rl.common.assert_layout_matches``)."""
    from tests.rl.common import assert_layout_matches

    metrics = ("policy_loss", "error_chosen", "error_rejected", "error_chosen_ref")
    assert_layout_matches(got, ref, witness, metrics, weak=weak)


@pytest.mark.dist
def test_sp2_equals_one_process(tiny_pipelines, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed
    from tests.rl.common import references

    raw = _full(tiny_pipelines, tmp_path, 2)
    ref, witness = references(dpo_iteration, raw)
    for got in run_distributed(dpo_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300):
        _compare(got, ref, witness)


@pytest.mark.dist
def test_fsdp_two_replicas_equal_one_process(tiny_pipelines, tmp_path: Path) -> None:
    """2 replicas with one pair each against one process taking both (the draws are per global pair)."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import references

    raw = _full(tiny_pipelines, tmp_path, 1)  # one pair per forward: a replica's layout, float32 sums alike
    ref, witness = references(dpo_iteration, raw)
    half = {**raw, "data": {**raw["data"], "prompts_per_step": 1}}
    for got in run_distributed(dpo_iteration, 2, half, timeout=300):
        _compare(got, ref, witness)


def test_dpo_moves_a_1d_gaussian_flow_toward_the_chosen_side() -> None:
    """A 1-D flow: the policy ``x0 ~ N(m, 1)`` with its exact velocity, the reference frozen at ``m = 0``. Pairs are
    two reference samples, the larger one chosen (``sign = 1``; the smaller one for ``-1``). Adam on the DPO
    objective (this package's ``dpo.objective``: the paper-reference test checks it) at random ``t`` with shared
    noise per pair: the mean passes ``+-0.5`` in the chosen direction within 40 steps (measured: 0.58)."""
    from runtime.rl.algorithms import dpo
    from runtime.rl.sampling import forward
    from tests.rl.test_algorithms_nft_dpo import _gaussian_velocity

    for sign in (1.0, -1.0):
        g = torch.Generator().manual_seed(1)
        m = torch.zeros((), dtype=torch.float64, requires_grad=True)
        zero = torch.zeros((), dtype=torch.float64)
        opt = torch.optim.Adam([m], lr=0.05)
        settings = dpo.Settings(beta=20.0)
        for _ in range(40):
            a, b = torch.randn(2, 64, generator=g, dtype=torch.float64)
            first = sign * a > sign * b
            win, lose = torch.where(first, a, b), torch.where(first, b, a)
            eps = torch.randn(64, generator=g, dtype=torch.float64)
            t = torch.rand(64, generator=g, dtype=torch.float64).clamp(0.02, 0.98)
            (xw, vw), (xl, vl) = forward.noised(win, eps, t), forward.noised(lose, eps, t)
            loss, _ = dpo.objective(
                settings,
                _gaussian_velocity(m, xw, t)[:, None],
                _gaussian_velocity(m, xl, t)[:, None],
                _gaussian_velocity(zero, xw, t)[:, None],
                _gaussian_velocity(zero, xl, t)[:, None],
                vw[:, None],
                vl[:, None],
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sign * float(m.detach()) > 0.5, (sign, float(m.detach()))


def test_pair_latents_are_encoded_once_and_equal_a_fresh_encoding(tiny_pipelines, tmp_path: Path) -> None:
    """Four pairs, two per iteration: four iterations see every pair twice, but the VAE encodes each of the eight
    images once (the run's latent cache), and a cached latent is bitwise a fresh encoding (the VAE's mode)."""
    from runtime.rl.loop import iteration
    from runtime.rl.pairs import encode_media
    from tests.rl.common import start

    run, _ = start(dpo_raw(tiny_pipelines, tmp_path))
    cm = run.policy.adapter.condition_model
    calls, encode = [], cm.encode_sample
    cm.encode_sample = lambda pixels: calls.append(1) or encode(pixels)  # this run's instance only
    for step in range(1, 5):
        iteration(run, step)
    assert len(calls) == 8 and len(run.latent_cache) == 8
    s = run.config.sampling
    for (path, height, width, frames), latent in run.latent_cache.items():
        assert (height, width, frames) == (s.height, s.width, s.frames)
        fresh = encode_media(cm, [Path(path)], ["test"], s.height, s.width, s.frames)[0]
        assert torch.equal(latent, fresh)
