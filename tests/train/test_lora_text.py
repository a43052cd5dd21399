"""LoRA (peft) in the trainer for a text, a vision-language and an omni model, MoE experts included:

* a run of 4 steps equals 2 steps + resume + 2 steps bitwise (losses, grad norms, adapter weights), and its
  checkpoints hold the adapter (and its optimizer state) only; the base comes back from ``model.path``;
* the adapter export loads through ``peft.PeftModel.from_pretrained`` on the plain transformers model (every adapter
  tensor in the file, none missing) and reproduces the trained model's logits; the merged export
  (``export.fuse_lora``) loads as a plain transformers checkpoint with the same logits (1e-5);
* MoE-LoRA under EP=2 (gloo): the experts' adapters' gradients, the losses and grad norms equal one process's, and
  the EP run resumes bitwise;
* user errors: a target that matches nothing (``lora.target_modules`` / ``lora.target_parameters``), a resume with
  another rank, each one line with exit code 2.

The base each run starts from is a random init saved as a plain transformers checkpoint (``model.path``), as a user
starts from a downloaded one.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed, start_reordered
from tests.omni.trainer_common import omni_run_config
from tests.tolerance import assert_steps_within_rounding, assert_within_rounding
from tests.train.common import TINY_MOE, run_config, run_main, witness_config
from tests.train.vlm_common import vlm_run_config

REL = 1e-5
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # the fused expert weights (peft target_parameters)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny models on a shared 2-core machine: intra-op threads cost wall time and change no result here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _train(raw: dict) -> Any:
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import train

    try:
        return train(parse_config(copy.deepcopy(raw)))
    finally:
        set_parallel_state(None)


def _save_base(raw: dict, root: Path) -> dict:
    """The run's random init (the trainer's own builder and seed), saved with ``save_pretrained`` as a plain
    checkpoint; ``raw`` rewritten to start from it (``model.path``)."""
    from runtime.train.config import parse_config
    from runtime.train.data import fixed_model_config, load_text_processor
    from runtime.train.model import build_model

    config = parse_config(raw)
    model = build_model(config.model, fixed_model_config(config, load_text_processor(config)))
    base = root / "base"
    model.save_pretrained(base)
    model_section = {k: v for k, v in raw["model"].items() if k != "config"}
    return {**raw, "model": {**model_section, "path": str(base)}}


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _steps(result: Any) -> list[tuple[float, float]]:
    return [(m.loss, m.grad_norm) for m in result.metrics]


def _text_case(root: Path) -> tuple[dict, str]:
    raw = run_config(root, lora={"rank": 4, "alpha": 8}, optim={"lr": 2e-2, "warmup_steps": 1})
    return raw, "AutoModelForCausalLM"


def _vlm_case(root: Path) -> tuple[dict, str]:
    raw = vlm_run_config(root, "qwen3_vl", lora={"rank": 4, "alpha": 8}, optim={"lr": 2e-2, "warmup_steps": 1})
    return raw, "AutoModelForImageTextToText"


def _omni_case(root: Path) -> tuple[dict, str]:
    """The MoE thinker with its experts adapted too (peft's ParamWrapper on the fused expert weights)."""
    lora = {"rank": 2, "alpha": 4, "target_parameters": EXPERTS}
    raw = omni_run_config(root, lora=lora, optim={"lr": 2e-2, "warmup_steps": 1})
    return raw, "AutoModelForImageTextToText"


CASES = {"text": _text_case, "vlm": _vlm_case, "omni": _omni_case}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _plain(auto: str, path: Path) -> torch.nn.Module:
    """A checkpoint loaded by plain transformers (eager experts: the numerical reference)."""
    import transformers

    model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    assert type(model).__module__.startswith("transformers."), type(model)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_resumes_bitwise_and_exports_both_ways(case: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    raw, auto = CASES[case](tmp_path)
    raw = _save_base(raw, tmp_path)
    ckpt = tmp_path / "ckpt"
    raw = {
        **raw,
        "train": {**raw["train"], "steps": 4},
        "checkpoint": {"dir": str(ckpt), "interval": 2, "save_total_limit": 3},
        "export": {"dir": str(tmp_path / "adapter")},
    }
    straight = _train(raw)
    saved = FileSystemReader(str(ckpt / "step_000002")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("/lora_A/" in k or "/lora_B/" in k for k in model_keys), model_keys[:4]

    shutil.rmtree(ckpt / "step_000004")
    resumed = _train({**raw, "export": {"dir": str(tmp_path / "merged"), "fuse_lora": True}})
    assert resumed.start_step == 2
    assert _steps(resumed) == _steps(straight)[2:]  # bitwise
    trained = _adapter(straight.model)
    again = _adapter(resumed.model)
    assert trained.keys() == again.keys() and all(torch.equal(trained[k], again[k]) for k in trained)
    assert all(not torch.equal(v, torch.zeros_like(v)) for k, v in trained.items() if ".lora_B." in k)  # trained
    if case == "omni":
        assert any("mlp.experts" in k for k in trained), sorted(trained)[:4]

    ids = torch.arange(3, 35).reshape(2, 16)
    reference = _logits(straight.model, ids)
    # (a) the adapter, on the plain base from model.path: every tensor of the file loaded, none missing
    base = _plain(auto, Path(raw["model"]["path"]))
    assert _relative(_logits(base, ids), reference) > 1e-3  # the adapter changes the outputs
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    file = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    held = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert file.keys() == held.keys() and len(file) == len(trained)
    assert all(torch.equal(file[k], held[k]) for k in file)
    assert not any("visual" in k or "audio_tower" in k for k in file)  # default: the language model only
    assert _relative(_logits(loaded, ids), reference) < REL
    # (b) merged: a plain transformers checkpoint
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert _relative(_logits(_plain(auto, tmp_path / "merged"), ids), reference) < REL


def _ep_raw(root: Path) -> dict:
    model = {"type": "qwen3_moe", "config": {**TINY_MOE, "router_aux_loss_coef": 0.0}, "seed": 0}
    lora = {"rank": 2, "alpha": 4, "target_parameters": EXPERTS}
    return run_config(root, model=model, lora=lora, optim={"lr": 2e-2, "warmup_steps": 1}, train={"steps": 4})


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _job_gradients(raw: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The adapter's gradients of step 2 of the trainer's own job, after a plain SGD step on step 1's gradients (at
    step 1 every B is zero, so every A's gradient is too); and step 2's loss."""
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import build_text_job, setup_parallel
    from runtime.train.preflight import check_inputs

    config = parse_config(raw)
    try:
        state = setup_parallel(config)
        torch.manual_seed(config.model.seed)
        job = build_text_job(config, state, check_inputs(config, state))
        job.model.train()
        trained = [p for p in job.model.parameters() if p.requires_grad]
        job.forward_backward(1)
        with torch.no_grad():
            for param in trained:
                param -= 10.0 * param.grad
                param.grad = None
        loss = job.forward_backward(2).loss.item()
        return loss, {n: _full(p.grad) for n, p in job.model.named_parameters() if p.requires_grad}
    finally:
        set_parallel_state(None)


def ep_worker(rank: int, world_size: int, raw: dict) -> dict:
    """Step 2's adapter gradients, then 4 steps with checkpoints, then the last 2 again from the step-2 checkpoint."""
    import torch.distributed as dist

    loss, grads = _job_gradients(raw)
    straight = _train(raw)
    adapter = {n: _full(p.detach()) for n, p in straight.model.named_parameters() if p.requires_grad}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(raw["checkpoint"]["dir"]) / "step_000004")
    dist.barrier()
    resumed = _train(raw)
    again = {n: _full(p.detach()) for n, p in resumed.model.named_parameters() if p.requires_grad}
    return {
        "loss": loss,
        "grads": grads,
        "steps": _steps(straight),
        "resumed": _steps(resumed),
        "adapter": adapter,
        "again": again,
    }


@pytest.mark.dist
def test_moe_lora_under_ep2_matches_one_process_and_resumes_bitwise(tmp_path: Path) -> None:
    """EP=2 on 2 ranks (grouped kernel; rows j and j+1 go to the two replicas) against one process with 2
    micro-batches (eager experts). The experts' adapters are replicated over the ep group (runtime/train/lora.py),
    each rank folding only its own experts' delta into their weights."""
    raw = _ep_raw(tmp_path / "single")
    reference_raw = {
        **raw,
        "model": {**raw["model"], "experts_implementation": "eager"},
        "train": {**raw["train"], "micro_batches": 2},
    }
    ep_raw = {
        **_ep_raw(tmp_path / "ep"),
        "parallel": {"ep": 2},
        "checkpoint": {"dir": str(tmp_path / "ep_ckpt"), "interval": 2, "save_total_limit": 3},
    }
    per_rank = run_distributed(ep_worker, 2, ep_raw, timeout=300)
    pending = start_reordered(_single_process_reference, witness_config(reference_raw))
    ref, witness = _single_process_reference(0, 1, reference_raw), pending()

    got = per_rank[0]
    assert any("mlp.experts" in k for k in ref["grads"]) and any("self_attn" in k for k in ref["grads"])
    assert all(g.abs().max() > 0 for g in ref["grads"].values())
    # step 2's loss and adapter gradients, the adapter after 4 steps, and the per-step (loss, grad norm), within the
    # rounding model (tests.tolerance: the reference on other kernels the witness)
    assert_within_rounding(got, ref, witness, ["loss", "grads", "adapter"], what="EP=2 LoRA")
    assert_steps_within_rounding(got["steps"], ref["steps"], witness["steps"], "EP=2 LoRA steps")
    for rank in per_rank:
        assert rank["resumed"] == rank["steps"][2:]  # bitwise
        assert all(torch.equal(rank["adapter"][k], rank["again"][k]) for k in rank["adapter"])


def _single_process_reference(rank: int, world_size: int, raw: dict) -> dict:
    """One process (this one, or the reordered rank of ``start_reordered``): step 2's loss and adapter gradients,
    then 4 steps."""
    loss, grads = _job_gradients(raw)
    result = _train(raw)
    return {"loss": loss, "grads": grads, "steps": _steps(result), "adapter": _adapter(result.model)}


def test_lora_user_errors_are_one_line(tmp_path: Path) -> None:
    cases = [
        ({"lora": {"rank": 4, "target_modules": ["nope_proj"]}}, "lora.target_modules: ['nope_proj']"),
        (
            {"lora": {"rank": 4, "target_parameters": EXPERTS[:1]}},
            "lora.target_parameters: 'mlp.experts.gate_up_proj'",
        ),
    ]
    # peft 0.21.2 turns a MoE model's regex into bare module names (here: every layer's q_proj): refused
    moe = {"type": "qwen3_moe", "config": TINY_MOE, "seed": 0}
    layer0 = {"rank": 4, "target_modules": r"model\.layers\.0\.self_attn\.q_proj"}
    cases.append(({"model": moe, "lora": layer0}, "adapted 1 module(s) it does not match"))
    for sections, expected in cases:
        code, err = run_main(run_config(tmp_path, train={"steps": 1}, **sections), tmp_path)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], err

    ckpt = {"dir": str(tmp_path / "ckpt"), "interval": 1}
    code, err = run_main(run_config(tmp_path, train={"steps": 1}, lora={"rank": 4}, checkpoint=ckpt), tmp_path)
    assert code == 0, err
    # two more steps under a re-planned schedule (the schedule is checked before the model is built): the adapter's
    # changed rank is what the resume refuses
    replan = {**ckpt, "schedule_change": "replan"}
    raw = run_config(tmp_path, train={"steps": 2}, lora={"rank": 8}, checkpoint=replan)
    code, err = run_main(raw, tmp_path)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "(lora.alpha: saved 4, this run 8; also lora.rank)" in lines[0], err
    assert "resume it with the lora settings it was saved with" in lines[0], err
