"""``eval: {path, every_steps, max_batches}``: the held-out loss the trainer logs is the plain model's mean token loss.

The reference is computed here, independently of the trainer's data path: each eval document tokenized with the
tokenizer itself (its ids + EOS, what a ``{"text": ...}`` line is), run unpacked through transformers' own
``Qwen3ForCausalLM`` holding the trained weights, token losses summed and divided by the target count. The trainer's
value (packed rows, DP-sharded with a masked padding row, or SP-sliced) must match it within the rounding model
(``tests.tolerance``): the trainer sums the token losses in another order than the unpacked reference, so the bound
scales with the reference's own float32 error against the same reference in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.tolerance import assert_within_rounding
from tests.train.common import TINY_MODEL, run_config, tokenizer_dir

EVAL_TEXTS = [
    "Every rank evaluates its rows; the token losses are summed over all of them.",
    "A row without targets adds nothing to the mean.",
    "Short line.",
    "Sequence parallel ranks slice each row and share its loss.",
    "The eval loss is comparable from one eval to the next: same rows, no dropout, no shuffling.",
    "Packed rows hold several documents, each with its own positions.",
    "Ninety-nine bottles of beer on the wall, ninety-nine bottles of beer.",
    "The end.",
]


def _eval_file(root: Path) -> Path:
    path = root / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in EVAL_TEXTS), encoding="utf-8")
    return path


def _config(root: Path, **sections: Any) -> dict:
    defaults = {"train": {"steps": 2}, "eval": {"path": str(_eval_file(root)), "every_steps": 1}}
    raw = run_config(root, **{k: {**defaults.get(k, {}), **v} for k, v in {**defaults, **sections}.items()})
    raw["data"]["token_budget"] = 64  # several eval rows: an odd count, so one replica gets a masked padding row
    return raw


def _train(raw: dict) -> dict[str, Any]:
    """The trainer's run (``build_text_job`` + ``run_job``); its metrics, full weights and eval plan."""
    from torch.distributed.tensor import DTensor

    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import build_text_job, run_job, setup_parallel
    from runtime.train.preflight import check_inputs

    config = parse_config(raw)
    with torch.random.fork_rng(devices=[]):
        try:
            state = setup_parallel(config)
            inputs = check_inputs(config, state)
            torch.manual_seed(config.model.seed)
            job = build_text_job(config, state, inputs)
            result = run_job(job, config, state)
            weights = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in result.model.state_dict().items()
            }
            return {
                "loss": [m.loss for m in result.metrics],
                "eval_loss": [m.eval_loss for m in result.metrics],
                "training": result.model.training,
                "weights": weights,
                "plan": None if job.evaluate is None else [list(row) for row in job.evaluate.plan],
            }
        finally:
            set_parallel_state(None)


def _worker(rank: int, world_size: int, raws: list[dict]) -> list[dict[str, Any]]:
    return [_train(raw) for raw in raws]


def _reference_eval_loss(
    weights: dict[str, torch.Tensor], root: Path, texts: list[str] = EVAL_TEXTS, dtype: torch.dtype = torch.float32
) -> float:
    import transformers

    config = transformers.AutoConfig.for_model("qwen3", **TINY_MODEL)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.load_state_dict(weights, strict=True)
    model.to(dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir(root))
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
            ids = torch.tensor([ids])
            out = model(input_ids=ids, labels=ids)  # mean over the ids.shape[1] - 1 shifted targets
            total += out.loss.double() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return (total / count).item()


def _assert_eval_loss(got: float, weights: dict[str, torch.Tensor], root: Path, texts: list[str] = EVAL_TEXTS) -> None:
    """The trainer's eval loss against the reference, its float64 twin the rounding model's witness."""
    reference = _reference_eval_loss(weights, root, texts)
    witness = _reference_eval_loss(weights, root, texts, torch.float64)
    assert_within_rounding({"eval_loss": got}, {"eval_loss": reference}, {"eval_loss": witness}, what="eval loss")


def _check(run: dict[str, Any], root: Path) -> None:
    assert None not in run["eval_loss"] and len(run["eval_loss"]) == 2
    assert run["training"]  # back in training mode after each eval
    assert len(run["plan"]) % 2 == 1  # with dp=2 the last round pads one replica
    _assert_eval_loss(run["eval_loss"][-1], run["weights"], root)


def test_eval_loss_is_the_plain_model_loss_in_one_process(tmp_path: Path) -> None:
    """Steps 1 and 2 (every_steps: 1) are evaluated; training is unchanged by the evals; without every_steps only
    the last step is."""
    with_eval = _train(_config(tmp_path))
    _check(with_eval, tmp_path)
    plain = run_config(tmp_path, train={"steps": 2})
    plain["data"]["token_budget"] = 64
    assert _train(plain)["loss"] == with_eval["loss"]


@pytest.mark.dist
def test_eval_loss_at_dp2_and_sp2(tmp_path: Path) -> None:
    raws = [_config(tmp_path), _config(tmp_path, parallel={"sp": 2})]
    for rank in run_distributed(_worker, 2, raws, timeout=300):
        for run in rank:
            _check(run, tmp_path)


def test_max_batches_limits_the_rows(tmp_path: Path) -> None:
    """``max_batches: 1`` in one process: the first packed row only (the plan says which documents it holds; the
    reference loss over those documents is computed as above)."""
    run = _train(_config(tmp_path, eval={"max_batches": 1, "every_steps": 0}))
    assert run["eval_loss"][0] is None  # every_steps 0: at the end only
    first = run["plan"][0]
    assert len(run["plan"]) > 1 and 0 < len(first) < len(EVAL_TEXTS)
    _assert_eval_loss(run["eval_loss"][1], run["weights"], tmp_path, [EVAL_TEXTS[i] for i in first])


def test_eval_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.train.config import parse_config

    no_file = run_config(tmp_path, eval={"every_steps": 5})
    with pytest.raises(ConfigError, match=r"^eval\.every_steps: set eval\.path"):
        parse_config(no_file)
    dit = {
        "model": {"type": "wan", "path": str(tmp_path / "wan")},
        "data": {"path": str(tmp_path / "clips.jsonl"), "buckets": [[9, 32, 32]]},
        "eval": {"path": str(tmp_path / "eval.jsonl")},
    }
    with pytest.raises(ConfigError, match=r"^eval: an eval-loss set is for text, VLM and omni models") as info:
        parse_config(dit)
    assert "validation" in str(info.value) and "\n" not in str(info.value)
