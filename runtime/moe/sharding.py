"""Expert parallelism: split the stacked expert parameters over the ep group, as the model's `_patchgen_ep_plan` says.

The plan is data in the generated modeling file (template `moe/ep_plan`): parameter-name suffix -> dim. Each
matching parameter becomes a DTensor sharded on the ep mesh (rank r holds experts [r*E/ep, (r+1)*E/ep)), so
FSDP2 can shard it further over the expert-data-parallel mesh and DCP / export see the global shape.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from runtime.moe.dispatch import KERNELS, register_experts_kernels
from runtime.parallel.state import ParallelState


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that own parameters named in the model's `_patchgen_ep_plan`."""
    plan = getattr(model, "_patchgen_ep_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no _patchgen_ep_plan: its spec needs the moe/ep_plan patch")
    owners: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        for suffix in plan:
            head, _, attr = suffix.rpartition(".")
            if (name == head or name.endswith("." + head)) and attr in module._parameters:
                owners[id(module)] = module
    return list(owners.values())


def shard_experts(model: nn.Module, state: ParallelState) -> list[nn.Module]:
    """Replace every planned parameter by this rank's experts (a DTensor on the ep mesh); no communication.

    Every rank must hold the same full parameters beforehand (same seed, or the same checkpoint).
    """
    if not state.ep_enabled:
        return []
    register_experts_kernels()
    impl = getattr(model.config, "_experts_implementation", None)
    if impl not in KERNELS:
        raise ValueError(f"expert parallelism needs experts_implementation in {sorted(KERNELS)}, found {impl!r}")
    mesh = state.ep_mesh["ep"]
    modules = expert_modules(model)
    for module in modules:
        for attr in _planned(model, module):
            full = module._parameters[attr]
            if full.shape[0] % state.ep_size:
                raise ValueError(f"{full.shape[0]} experts cannot be split over ep={state.ep_size}")
            local = full.detach().chunk(state.ep_size, dim=0)[state.ep_rank].clone()
            dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            module._parameters[attr] = nn.Parameter(dtensor, requires_grad=full.requires_grad)
        module.ep_sharded = True
    return modules


def _planned(model: nn.Module, module: nn.Module) -> list[str]:
    return sorted({suffix.rpartition(".")[2] for suffix in model._patchgen_ep_plan} & set(module._parameters))
