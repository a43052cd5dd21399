"""Rule: no optimizer step ever applies a non-finite update, and a run never ends with exit 0 after one. A
non-finite loss, gradient norm or learning rate stops every trainer (text, DiT, Flow-GRPO; VLM and omni models share
the text path) with one line naming the step and the samples or cache shard it came from, exit 2, and the parameters
are then those of the last good step; with ``train.nonfinite: skip`` the step's update is skipped and counted
(``skipped_nonfinite``), nothing else. All ranks agree. DiT condition-cache shards are hashed when written and
checked before they are read (a changed shard is one line naming it), and conditions that are not finite are
refused when they are written (naming the sample)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train.common import run_config, run_main


def _one_line_exit_2(code: int, stderr: str, *needles: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, stderr)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _build_and_run(config: Any) -> tuple[Any, dict[str, torch.Tensor], BaseException | None, Any]:
    """The trainer's own steps (``train``, with the job kept): (job, parameters before the run, the error, result)."""
    from runtime.parallel.state import set_parallel_state
    from runtime.train.loop import build_text_job, run_job, setup_parallel
    from runtime.train.preflight import check_inputs

    with torch.random.fork_rng(devices=[]):
        try:
            state = setup_parallel(config)
            inputs = check_inputs(config, state)
            torch.manual_seed(config.model.seed)
            job = build_text_job(config, state, inputs)
            before = _params(job.model)
            try:
                return job, before, None, run_job(job, config, state, inputs.resume_from)
            except Exception as exc:  # noqa: BLE001 - handed to the test
                return job, before, exc, None
        finally:
            set_parallel_state(None)


def _config(raw: dict, **optim: float) -> Any:
    """``raw`` parsed, then ``optim`` values set directly: what the guard sees when config validation is bypassed."""
    from runtime.train.config import parse_config

    config = parse_config(raw)
    return dataclasses.replace(config, optim=dataclasses.replace(config.optim, **optim))


# ----------------------------------------------------------------------------------------------- learning rate


@pytest.mark.parametrize("lr", [math.inf, math.nan])
def test_non_finite_lr_never_updates(tmp_path: Path, lr: float) -> None:
    from runtime.config.errors import ConfigError

    job, before, error, _ = _build_and_run(_config(run_config(tmp_path), lr=lr))
    assert isinstance(error, ConfigError) and "optim.lr" in str(error) and "\n" not in str(error), error
    _assert_same(_params(job.model), before)


def test_lr_that_turns_non_finite_mid_run_stops_before_that_step(tmp_path: Path) -> None:
    """Validation keeps ``min_lr_ratio`` in [0, 1] and transformers' schedules clamp at 0; bypassing it, ``lr: 1e10``
    with ``min_lr_ratio: 1e308`` gives transformers' cosine_with_min_lr the lrs 0 (warmup step 1), 0 (step 2:
    1e308 * (1 - 1) rounds to 0) and then 1e10 * 1.5e307 = inf from step 3: the run stops there, before the update,
    with the parameters of step 2 (those of a 2-step run, whose lrs are 0 and 0 as well)."""
    from runtime.train.finite import NonFiniteError

    raw = run_config(tmp_path, optim={"lr": 1e10, "warmup_steps": 1}, train={"steps": 5})
    job, _, error, _ = _build_and_run(_config(raw, min_lr_ratio=1e308))
    assert isinstance(error, NonFiniteError) and "step 3" in str(error) and "learning rate" in str(error), error
    reference_raw = run_config(tmp_path, optim={"lr": 1e10, "warmup_steps": 1}, train={"steps": 2})
    reference, _, none, _ = _build_and_run(_config(reference_raw, min_lr_ratio=1e308))  # lrs 0, 0 too
    assert none is None
    _assert_same(_params(job.model), _params(reference.model))


def test_infinite_lr_in_the_yaml_is_one_line(tmp_path: Path) -> None:
    """Whoever catches it (config validation or the guard), ``optim.lr: .inf`` is exit 2 naming optim.lr."""
    raw = run_config(tmp_path)
    raw["optim"]["lr"] = float("inf")
    _one_line_exit_2(*run_main(raw, tmp_path), "optim.lr")
    assert not (tmp_path / "log" / "metrics.jsonl").exists() or not (tmp_path / "log" / "metrics.jsonl").read_text()


# ------------------------------------------------------------------------------------------------------ text model


def test_text_model_blowing_up_names_step_and_samples(tmp_path: Path) -> None:
    """Weights of 1e30 overflow the activations: step 1's gradient (or loss) is not finite. Stopped there, the
    parameters untouched, the message naming the step and the data (a .txt corpus: its documents)."""
    from runtime.train.finite import NonFiniteError

    raw = run_config(tmp_path)
    raw["model"]["config"]["initializer_range"] = 1e30
    job, before, error, _ = _build_and_run(_config(raw))
    assert isinstance(error, NonFiniteError), error
    message = str(error)
    assert message.startswith("step 1: the ") and "not finite" in message, message
    assert "corpus.txt document" in message and "\n" not in message, message
    _assert_same(_params(job.model), before)


# ------------------------------------------------------------------------------------------ the shared loop, a toy


class _Rows:
    """A resumable loader of nothing (the toy job draws its data from the step number)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _toy_job(rank: int, bad_steps: dict[int, set[int]], snapshots: list) -> Any:
    """A one-layer job for ``run_job``: step ``s`` on rank ``r`` trains on a NaN sample when ``r in bad_steps[s]``;
    its loss is this rank's own (not reduced), so only the guard's all-reduce makes the ranks agree."""
    from runtime.train.loop import Job, StepWork

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    def forward_backward(step: int) -> StepWork:
        snapshots.append(_params(model))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        if rank in bad_steps.get(step, ()):
            x[1, 2] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        return StepWork(
            loss=loss.detach(),
            count=3,
            processed=3,
            micro_losses=[loss.detach()],
            describe=lambda: [[f"toy.jsonl:{step} on rank {rank}"]],
        )

    return Job(
        model=model,
        loader=_Rows(),
        forward_backward=forward_backward,
        flops_per_token=1.0,
        identity={"type": "toy", "config": {}},
    )


def _toy_config(log_dir: str, nonfinite: str, steps: int = 4) -> Any:
    from runtime.config.common import LogConfig, OptimConfig
    from runtime.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig

    return RunConfig(
        model=ModelConfig(type="toy"),
        data=DataConfig(path="toy.jsonl"),
        optim=OptimConfig(lr=0.1, warmup_steps=0, min_lr_ratio=0.5),
        train=TrainConfig(steps=steps, nonfinite=nonfinite),
        log=LogConfig(dir=log_dir, progress=False),
    )


def _toy_worker(rank: int, world_size: int, log_dir: str, nonfinite: str, bad: dict[int, set[int]]) -> dict:
    from runtime.train.loop import run_job, setup_parallel

    config = _toy_config(log_dir, nonfinite)
    state = setup_parallel(config)
    snapshots: list = []
    job = _toy_job(rank, bad, snapshots)
    try:
        result = run_job(job, config, state)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        after, last_good = _params(job.model), snapshots[-1] if snapshots else {}
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "unchanged": all(torch.equal(after[k], v) for k, v in last_good.items()),
        }
    return {
        "metrics": [dataclasses.asdict(m) for m in result.metrics],
        "snapshots": snapshots,
        "final": _params(job.model),
    }


@pytest.mark.dist
def test_ranks_stop_together_when_one_rank_is_not_finite(tmp_path: Path) -> None:
    """Rank 1 alone meets a NaN sample at step 3: both ranks stop at step 3 with the same line naming it, and
    neither applied step 3's update."""
    out = run_distributed(_toy_worker, 2, str(tmp_path / "log"), "stop", {3: {1}}, timeout=120)
    assert out[0]["error"] == out[1]["error"], out
    assert out[0]["error"].startswith("NonFiniteError: step 3: the loss"), out
    assert "toy.jsonl:3 on rank 1" in out[0]["error"] and "rank 0" not in out[0]["error"], out
    assert out[0]["unchanged"] and out[1]["unchanged"]


def test_skip_drops_the_update_and_counts_it(tmp_path: Path) -> None:
    """``train.nonfinite: skip``: step 2's update is not applied (step 3 starts from step 2's parameters), the
    schedule still advances (the lr of every step is that of a run without the NaN), and the metrics count it."""
    skipped = _toy_worker(0, 1, str(tmp_path / "a"), "skip", {2: {0}})
    clean = _toy_worker(0, 1, str(tmp_path / "b"), "skip", {})
    metrics = skipped["metrics"]
    assert [m["skipped_nonfinite"] for m in metrics] == [0, 1, 1, 1]
    assert [m["lr"] for m in metrics] == [m["lr"] for m in clean["metrics"]]
    _assert_same(skipped["snapshots"][2], skipped["snapshots"][1])  # step 3 starts where step 2 started
    assert all(torch.isfinite(p).all() for p in skipped["final"].values())
    lines = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [line["skipped_nonfinite"] for line in lines] == [0, 1, 1, 1]


def test_nonfinite_mode_must_be_known(tmp_path: Path) -> None:
    out = _toy_worker(0, 1, str(tmp_path), "ignore", {})
    assert out["error"].startswith("ConfigError: train.nonfinite:") and "ignore" in out["error"], out


# ------------------------------------------------------------------------------------------------------- DiT cache


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The DiT trainer tests' tiny pipelines and clips (``tests/train/dit_common.py``)."""
    from tests.train.dit_common import make_files

    return make_files(tmp_path_factory.mktemp("wan"))


def _wan_config(wan: dict[str, Path], work: Path, cache: Path, **sections: Any) -> dict:
    raw = {
        "model": {"type": "wan", "path": str(wan["wan"]), "seed": 0},
        "data": {"path": str(wan["clips"]), "buckets": [[9, 32, 32]], "cache": str(cache)},
        "optim": {"lr": 2e-3, "warmup_steps": 1},
        "train": {"steps": 2},
        "log": {"dir": str(work / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _filled_cache(wan: dict[str, Path], tmp_path: Path) -> Path:
    """A cache of the clips' conditions, written by a real run."""
    cache = tmp_path / "cache"
    assert run_main(_wan_config(wan, tmp_path / "fill", cache, train={"steps": 1}), tmp_path)[0] == 0
    return cache


def _rewrite_shard(shard: Path, tensors: dict[str, torch.Tensor], rehash: bool) -> None:
    import hashlib

    from safetensors.torch import save_file

    save_file(tensors, shard, metadata={"format": "patchgen-dit-conditions", "version": "2"})
    if rehash:
        data = shard.read_bytes()
        record = shard.with_name(shard.name.replace(".safetensors", ".sha256"))
        record.write_text(json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


def _shard(cache: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    (shard,) = cache.glob("conditions-*.safetensors")
    return shard, load_file(shard)


def test_cache_shard_with_changed_bytes_is_named(wan, tmp_path: Path) -> None:
    cache = _filled_cache(wan, tmp_path)
    shard, tensors = _shard(cache)
    name = next(k for k in tensors if k.endswith("/latents"))
    tensors[name] = tensors[name] * 1.0001  # plausible values, other bytes: only the hash can tell
    _rewrite_shard(shard, tensors, rehash=False)
    raw = _wan_config(wan, tmp_path / "run", cache)
    _one_line_exit_2(*run_main(raw, tmp_path), "data.cache", shard.name, "sha256")
    assert not (tmp_path / "run" / "log").exists()  # refused before the first step


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nan_shard_with_recomputed_hashes_stops_naming_it(wan, tmp_path: Path, mode: str) -> None:
    """A planted shard of NaN latents that verifies (its record recomputed): step 1's loss is NaN. ``stop``: exit 2
    naming step 1, a sample's file:line and the shard; ``skip``: exit 0, every step skipped and counted."""
    cache = _filled_cache(wan, tmp_path)
    shard, tensors = _shard(cache)
    _rewrite_shard(
        shard, {k: v.fill_(float("nan")) if k.endswith("/latents") else v for k, v in tensors.items()}, True
    )
    raw = _wan_config(wan, tmp_path / "run", cache, train={"steps": 2, "nonfinite": mode})
    code, stderr = run_main(raw, tmp_path)
    if mode == "stop":
        _one_line_exit_2(code, stderr, "step 1:", "not finite", "data.jsonl:", shard.name)
        return
    assert code == 0, stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [line["skipped_nonfinite"] for line in lines] == [1, 2]


def test_nan_shard_leaves_the_transformer_as_loaded(wan, tmp_path: Path) -> None:
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.dit import build_dit_job
    from runtime.train.finite import NonFiniteError
    from runtime.train.loop import run_job, setup_parallel
    from runtime.train.preflight import check_inputs

    cache = _filled_cache(wan, tmp_path)
    shard, tensors = _shard(cache)
    _rewrite_shard(
        shard, {k: v.fill_(float("nan")) if k.endswith("/latents") else v for k, v in tensors.items()}, True
    )
    config = parse_config(_wan_config(wan, tmp_path / "run", cache))
    with torch.random.fork_rng(devices=[]):
        try:
            state = setup_parallel(config)
            job = build_dit_job(config, state, check_inputs(config, state))
            before = _params(job.model)
            with pytest.raises(NonFiniteError, match="step 1: the loss"):
                run_job(job, config, state)
        finally:
            set_parallel_state(None)
    _assert_same(_params(job.model), before)


def test_non_finite_conditions_are_refused_when_written(wan, tmp_path: Path) -> None:
    """A VAE weight set to NaN makes every latent NaN: refused while filling the cache, naming the first sample's
    file:line; no shard is written."""
    import shutil

    from safetensors.torch import load_file, save_file

    pipeline = tmp_path / "wan"
    shutil.copytree(wan["wan"], pipeline)
    (weights,) = (pipeline / "vae").glob("*.safetensors")
    state = load_file(weights)
    name = "encoder.conv_in.weight"
    state[name][0].fill_(float("nan"))
    save_file(state, weights)
    raw = _wan_config({**wan, "wan": pipeline}, tmp_path / "run", tmp_path / "cache")
    code, stderr = run_main(raw, tmp_path)
    progress = "".join(line for line in stderr.splitlines(True) if line.startswith("conditions: computing"))
    _one_line_exit_2(code, stderr.replace(progress, ""), "data.jsonl:1", "latents", "not finite")
    assert not list((tmp_path / "cache").glob("conditions-*"))


# Flow-GRPO's (the RL job's) non-finite guards: tests/rl/test_nonfinite.py
