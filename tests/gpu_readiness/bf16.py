"""One forward+backward of each family's generated model in fp32, under bf16 autocast, or with bf16 parameters.

Families: dense (qwen3), MoE (qwen3_moe, grouped experts), VLM (qwen3_vl: ViT, deepstack and LM on a two-image row)
and DiT (Wan). Under SP each rank takes its slice (the parity tests' sharding) and the parameter gradients are summed
over the SP group in fp32 (the partial-gradient convention), so every run returns the full loss and gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.models.tiny_configs import random_packed_batch, tiny_config

FAMILIES = {"dense": "qwen3", "moe": "qwen3_moe", "vlm": "qwen3_vl", "dit": "wan"}
MODES = ("fp32", "autocast", "bf16")
LENGTHS = (23, 18, 9)  # a packed text row of three sequences (50 tokens: SP=2 slices of 25)


def _model(family: str) -> torch.nn.Module:
    model_type = FAMILIES[family]
    if family == "dit":
        from tests.dit.cases import CASES, shell

        return shell(CASES[model_type])
    from runtime.models.registry import lookup
    from runtime.moe.dispatch import register_experts_kernels

    register_experts_kernels()
    overrides = {"experts_implementation": "patchgen_grouped"} if family == "moe" else {}
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    return lookup(model_type).causal_lm_class()(config)


def _inputs(family: str, sp: int, sp_rank: int) -> dict[str, Any]:
    model_type = FAMILIES[family]
    if family == "dit":
        from tests.dit.cases import CASES, inputs

        return inputs(CASES[model_type])  # the DiT's SP hooks slice the tokens themselves
    if family == "vlm":
        from tests.parity.test_vlm_sp import CASES, full_batch, shard

        batch = full_batch(model_type, *CASES[0])
        return shard(batch, sp, sp_rank) if sp > 1 else batch
    from runtime.data.sp_batch import shard_row

    batch = random_packed_batch(LENGTHS, tiny_config(model_type).vocab_size)
    return shard_row(batch, sp, sp_rank) if sp > 1 else batch


def _loss(family: str, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    if family == "dit":
        from tests.dit.cases import target_like

        out = _at_least_fp32(model(**inputs)[0])
        return torch.nn.functional.mse_loss(out, target_like(out))
    return _at_least_fp32(model(**inputs, **({"output_router_logits": True} if family == "moe" else {})).loss)


def _at_least_fp32(value: torch.Tensor) -> torch.Tensor:
    """A bf16 result in fp32 for the loss; an fp64 one (a rounding witness) kept in fp64."""
    return value.to(torch.promote_types(value.dtype, torch.float32))


def _bf16(key: str, value: Any) -> Any:
    """Floating inputs in bf16, except a DiT's timestep: pipelines pass it in fp32 (bf16 rounds t = 500 to 2 units)."""
    if key == "timestep" or not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    return value.to(torch.bfloat16)


def run(family: str, mode: str, sp_group: Any = None) -> dict[str, Any]:
    """``{"loss": fp64 scalar, "grads": {name: fp32 gradient}}`` of one step in ``mode`` (see ``MODES``)."""
    import torch.distributed as dist

    sp = 1 if sp_group is None else dist.get_world_size(sp_group)
    sp_rank = 0 if sp_group is None else dist.get_rank(sp_group)
    model = _model(family)
    inputs = _inputs(family, sp, sp_rank)
    if mode == "bf16":
        model.to(torch.bfloat16)
        inputs = {k: _bf16(k, v) for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        loss = _loss(family, model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    if sp_group is not None:
        for grad in grads.values():
            dist.all_reduce(grad, group=sp_group)
    return {"loss": loss.detach().double(), "grads": grads}


def errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Relative errors: the loss, and the gradient of all parameters as one vector (norm-wise)."""
    assert got["grads"].keys() == ref["grads"].keys()
    diff = sum((got["grads"][n].double() - g.double()).norm() ** 2 for n, g in ref["grads"].items()) ** 0.5
    total = sum(g.double().norm() ** 2 for g in ref["grads"].values()) ** 0.5
    return {
        "loss": (abs(got["loss"] - ref["loss"]) / abs(ref["loss"])).item(),
        "grad": (diff / total).item(),
    }


def sp_worker(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every (family, mode) case at sp=world on gloo ranks."""
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world)
    return [run(family, mode, state.sp_group) for family, mode in cases]
