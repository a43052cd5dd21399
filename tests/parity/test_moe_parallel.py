"""Every MoE causal LM (spec capability `moe`) with expert parallelism (+SP, +FSDP) against the single-process
eager run, within the rounding model (``tests.tolerance``; the float64 run the truth)."""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import model_types, variant_cases
from tests.dist_utils import run_distributed
from tests.parity.dense import grads as trainable_grads
from tests.supports import CAPABILITIES, needs, require, supporting
from tests.tolerance import assert_within_rounding

# One packed row per data-parallel replica. Odd totals (23, 23, then 20, 21): under SP the row gets a padding token
# that is routed like any token but must count nowhere in the load-balancing loss (the collator's token_mask), so the
# runs equal the unpadded single-process reference (issue 12 item 3).
LENGTHS = [(9, 14), (7, 5, 11), (13, 7), (4, 17)]


# every MoE causal LM's tiny config and each tiny variant, named "<model_type>" or "<model_type>/<variant>"
MOE_MODELS = [t if v is None else f"{t}/{v}" for t, v in variant_cases(model_types("causal_lm", capability="moe"))]


def _model(case: str, experts_implementation: str):
    from runtime.models.registry import causal_lm_class, variant_overrides
    from runtime.models.tiny_configs import tiny_config
    from runtime.moe.dispatch import KERNELS, LAYOUT_KERNEL, expert_layout_problem

    model_type, _, variant = case.partition("/")
    overrides = variant_overrides(model_type, variant or None)
    config = tiny_config(model_type, experts_implementation=experts_implementation, **overrides)
    torch.manual_seed(0)
    model = causal_lm_class(model_type)(config)
    experts = [m for m in model.modules() if hasattr(m, "has_gate")]
    if experts_implementation in KERNELS and any(expert_layout_problem(m) for m in experts):
        # experts the fused kernels do not compute (biases, interleaved gate/up, a clamped gate): the layout kernel
        return _model(case, LAYOUT_KERNEL)
    with torch.no_grad():  # skewed routing: some experts get no token on some rank
        for name, module in model.named_modules():
            if name.endswith(("mlp.gate", "mlp.router")):
                module.weight[:3] *= 4.0
    return model


def _losses(out, config) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(language-model loss, load-balancing loss or None): what the config and the output have (an aux-loss-free
    router has neither ``router_aux_loss_coef`` nor ``aux_loss``)."""
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return out.loss, None
    return out.loss - getattr(config, "router_aux_loss_coef", 0.0) * aux, aux


def _rows(n: int) -> list[dict]:
    from runtime.models.tiny_configs import random_packed_batch

    return [random_packed_batch(LENGTHS[i], 97, seed=10 + i) for i in range(n)]


def reference(model_type: str, num_rows: int, dtype: torch.dtype = torch.float32) -> dict:
    """One process, eager experts, every replica's row as a row of one batch (rows of equal length) or packed into
    one row: the global mean. Rows of a batch suit every model, also one whose masks ignore packed documents
    (gpt_oss builds them without position ids, as upstream does). ``dtype=torch.float64``: the rounding model's
    truth."""
    rows = _rows(num_rows)
    equal = len({r["input_ids"].shape[1] for r in rows}) == 1
    batch = {k: torch.cat([r[k] for r in rows], 0 if equal else 1) for k in rows[0]}
    model = _model(model_type, "eager").to(dtype)
    out = model(**batch)
    out.loss.backward()
    lm, aux = _losses(out, model.config)
    return {
        "lm": lm.detach(),
        "aux": None if aux is None else aux.detach(),
        "grads": trainable_grads(model),
    }


def parallel_worker(rank: int, world: int, layout: dict, models: list[str]) -> dict[str, dict]:
    return {model_type: _parallel_run(rank, model_type, layout) for model_type in models}


def _parallel_run(rank: int, model_type: str, layout: dict) -> dict:
    import torch.distributed as dist

    from runtime.data.sp_batch import shard_for_sp
    from runtime.moe.dispatch import register_experts_kernels
    from runtime.parallel.expert_parallel import apply_ep
    from runtime.parallel.fsdp import apply_fsdp
    from runtime.parallel.state import init_parallel_state

    register_experts_kernels()  # our kernels, in transformers' ExpertsInterface
    state = init_parallel_state(**layout)
    model = _model(model_type, "patchgen_grouped")
    apply_ep(model, state)
    apply_fsdp(model, state)
    rows = _rows(state.dp_size)
    tokens = sum(int((r["labels"][:, 1:] != -100).sum()) for r in rows)
    out = model(**shard_for_sp(rows[state.dp_rank], state), num_items_in_batch=tokens)
    out.loss.backward()
    lm, aux = _losses(out, model.config)
    lm_share = lm.detach()
    dist.all_reduce(lm_share, group=state.dp_group)
    grads = {n.replace("_fsdp_wrapped_module.", ""): g for n, g in trainable_grads(model).items()}
    aux = None if aux is None else aux.detach()
    return {"lm": lm_share, "aux": aux, "grads": grads if rank == 0 else None}


LAYOUTS = {
    "sp2": (2, {"sp_size": 2}),
    "ep2": (2, {"ep_size": 2}),
    "ep2_sp2": (4, {"ep_size": 2, "sp_size": 2}),
    "ep2_ring2": (2, {"ep_size": 2, "sp_size": 2, "ring_size": 2}),  # ring attention (issue 24)
    "ep2_ulysses2_ring2": (4, {"ep_size": 2, "sp_size": 4, "ring_size": 2}),
    "ep2_ring4": (4, {"ep_size": 2, "sp_size": 4, "ring_size": 4}),
}


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("model_type", model_types("causal_lm", capability="moe"))
def test_every_moe_lm_runs_at_each_layout_or_states_why(model_type: str, capability: str) -> None:
    require(model_type, capability)


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_expert_parallel_matches_single_process(name: str) -> None:
    world, layout = LAYOUTS[name]
    # the models whose class supports the layout (the others: test_every_moe_lm_runs_at_each_layout_or_states_why)
    runnable = set(supporting({m.partition("/")[0] for m in MOE_MODELS}, *needs(layout)))
    models = [m for m in MOE_MODELS if m.partition("/")[0] in runnable]
    results = run_distributed(parallel_worker, world, layout, models, timeout=300)
    dp = world // layout.get("sp_size", 1)
    for model_type in models:  # within the rounding model (tests.tolerance), the float64 run the truth
        ref, truth = reference(model_type, dp), reference(model_type, dp, torch.float64)
        for rank, got in enumerate(r[model_type] for r in results):
            assert (got["aux"] is None) == (ref["aux"] is None), model_type
            keys = ["lm"] + (["aux"] if ref["aux"] is not None else []) + (["grads"] if rank == 0 else [])
            assert_within_rounding(got, ref, truth, keys, what=f"{model_type} {name} rank {rank}")
