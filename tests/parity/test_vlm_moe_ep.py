"""Every MoE VLM (spec capability `moe`) with expert parallelism (+Ulysses SP, +FSDP2) against the single-process
eager run: the LM loss, the load-balancing loss and every gradient (ViT, merger, deepstack mergers, router,
experts, text layers) within the rounding model (``tests.tolerance``; the float64 run the truth).

Each data-parallel replica trains a different VLM row (test_vlm_sp's CASES, one per replica; under SP the second
one holds both images on SP rank 0 only and has 35 tokens, so SP pads it). The load-balancing loss is
over the global token set of real tokens (the SP padding is routed but masked out by the collator's token_mask), so
the reference packs every replica's unpadded row into one row: pixel_values and image_grid_thw concatenated in
order, position ids concatenated along L (each row's text positions restart at 0, so the packing mask keeps the
rows apart; checked below).
"""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import lookup, model_types
from tests.dist_utils import run_distributed
from tests.parity.dense import grads as trainable_grads
from tests.parity.dense import relative_error
from tests.parity.test_vlm_sp import CASES, forward_kwargs, full_batch, shard
from tests.supports import needs, require, supporting
from tests.tolerance import assert_within_rounding

MOE_VLMS = model_types("vlm", capability="moe")
# The dim along which the packed reference concatenates the rows' tensors.
PACKED_KEYS = {
    "input_ids": 1,
    "labels": 1,
    "mm_token_type_ids": 1,
    "position_ids": 2,
    "pixel_values": 0,
    "image_grid_thw": 0,
}


def _model(model_type: str, experts_implementation: str):
    from runtime.models.registry import causal_lm_class
    from runtime.models.tiny_configs import tiny_config

    config = tiny_config(model_type, experts_implementation=experts_implementation)
    torch.manual_seed(0)
    model = causal_lm_class(model_type)(config)
    with torch.no_grad():  # skewed routing (as test_moe_parallel); under ep2_sp2, layer 1's experts 5-7 get no
        # token from rank 2 or 3 (the router has no bias, so no expert is starved on a whole EP group)
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight[:3] *= 4.0
    return model


def _rows(model_type: str, n: int) -> list[dict[str, torch.Tensor]]:
    """One row per data-parallel replica. A row's first token is nobody's target; marking it ignored changes
    nothing for the replica but keeps the packed reference from predicting it from the previous row's last token."""
    rows = []
    for grids, text in CASES[:n]:
        row = full_batch(model_type, grids, text)
        row["labels"][:, 0] = -100
        rows.append(row)
    return rows


def _targets(rows: list[dict[str, torch.Tensor]]) -> int:
    return sum(int((r["labels"][:, 1:] != -100).sum()) for r in rows)


def _packed(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r[k] for r in rows], dim) for k, dim in PACKED_KEYS.items()}


def reference(model_type: str, num_rows: int, dtype: torch.dtype = torch.float32) -> dict:
    """One process, eager experts, every replica's (unpadded) row packed into one row: the global mean
    (``dtype=torch.float64``: weights and pixels in float64, the rounding model's truth)."""
    model = _model(model_type, "eager").to(dtype)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _packed(_rows(model_type, num_rows)).items()}
    out = model(**batch, **forward_kwargs(model_type))
    out.loss.backward()
    coef = model.config.text_config.router_aux_loss_coef
    return {
        "lm": (out.loss - coef * out.aux_loss).detach(),
        "aux": out.aux_loss.detach(),
        "grads": trainable_grads(model),
    }


def parallel_worker(rank: int, world: int, layout: dict, models: list[str]) -> dict[str, dict]:
    return {model_type: _parallel_run(rank, model_type, layout) for model_type in models}


def _parallel_run(rank: int, model_type: str, layout: dict) -> dict:
    import torch.distributed as dist

    from runtime.moe.dispatch import register_experts_kernels
    from runtime.parallel.expert_parallel import apply_ep
    from runtime.parallel.fsdp import apply_fsdp
    from runtime.parallel.state import init_parallel_state

    register_experts_kernels()  # our kernels, in transformers' ExpertsInterface
    state = init_parallel_state(**layout)
    model = _model(model_type, "patchgen_grouped")
    apply_ep(model, state)
    apply_fsdp(model, state)
    rows = _rows(model_type, state.dp_size)
    batch = shard(rows[state.dp_rank], state.sp_size, state.sp_rank)
    out = model(**batch, num_items_in_batch=_targets(rows), **forward_kwargs(model_type))
    out.loss.backward()
    coef = model.config.text_config.router_aux_loss_coef
    lm_share = (out.loss - coef * out.aux_loss).detach()
    dist.all_reduce(lm_share, group=state.dp_group)
    grads = {n.replace("_fsdp_wrapped_module.", ""): g for n, g in trainable_grads(model).items()}  # collective
    return {"lm": lm_share, "aux": out.aux_loss.detach(), "grads": grads if rank == 0 else None}


LAYOUTS = {
    "ep2": (2, {"ep_size": 2}),
    "ep2_sp2": (4, {"ep_size": 2, "sp_size": 2}),
}


@pytest.mark.parametrize("model_type", MOE_VLMS[:1])  # named in the id: `upgrade --verify` gives it to that model
def test_packed_reference_keeps_rows_apart(model_type: str) -> None:
    """The packed reference row computes each row's logits exactly as that row alone does."""
    model = _model(model_type, "eager")
    rows = _rows(model_type, 2)
    with torch.no_grad():
        packed = model(**_packed(rows)).logits
        alone = torch.cat([model(**r).logits for r in rows], 1)
    assert relative_error(packed, alone) < 1e-5


@pytest.mark.parametrize("capability", ["sp", "ep"])
@pytest.mark.parametrize("model_type", MOE_VLMS)
def test_every_moe_vlm_runs_at_ep_and_sp_or_states_why(model_type: str, capability: str) -> None:
    require(model_type, capability)


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_vlm_expert_parallel_matches_single_process(name: str) -> None:
    world, layout = LAYOUTS[name]
    sp = layout.get("sp_size", 1)
    models = supporting(MOE_VLMS, *needs(layout))  # the others: test_every_moe_vlm_runs_at_ep_and_sp_or_states_why
    results = run_distributed(parallel_worker, world, layout, models, timeout=300)
    for model_type in models:  # within the rounding model (tests.tolerance), the float64 run the truth
        ref, truth = reference(model_type, world // sp), reference(model_type, world // sp, torch.float64)
        for rank, got in enumerate(r[model_type] for r in results):
            keys = ["lm", "aux"] + (["grads"] if rank == 0 else [])
            assert_within_rounding(got, ref, truth, keys, what=f"{model_type} {name} rank {rank}")
        grads = results[0][model_type]["grads"]
        parts = [
            "model.visual.blocks.",
            "model.visual.merger.",
            "mlp.gate.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "self_attn.q_proj",
        ]
        if lookup(model_type).has("deepstack"):
            parts.append("model.visual.deepstack_merger_list.")
        for part in parts:
            assert any(part in key for key in grads), (model_type, part)
