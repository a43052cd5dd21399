"""Expert parallelism: split the stacked expert parameters over the ep group, as the model's `_patchgen_ep_plan` says.

The plan is data in the generated modeling file (template `moe/ep_plan`): parameter-name suffix -> dim. Each
matching parameter becomes a DTensor sharded on the ep mesh (rank r holds experts [r*E/ep, (r+1)*E/ep)), so
FSDP2 can shard it further over the expert-data-parallel mesh and DCP / export see the global shape. The sharded
modules are flagged ``ep_sharded``: the experts kernels (``runtime/moe/dispatch.py``) then dispatch tokens over the
ep group; a kernel that cannot (upstream's eager loop) is refused before this runs
(``runtime.moe.dispatch.check_ep_kernel``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from runtime.parallel.state import ParallelState

__all__ = ["apply_ep", "check_ep", "expert_modules"]


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


def check_ep(model: nn.Module, state: ParallelState) -> None:
    """Refuse, before anything is sharded, a model without an EP plan or whose experts do not split over ep."""
    for module in expert_modules(model):
        for attr in _planned(model, module):
            experts = module._parameters[attr].shape[0]
            if experts % state.ep_size:
                raise ValueError(f"{experts} experts cannot be split over ep={state.ep_size}")


def apply_ep(model: nn.Module, state: ParallelState) -> list[nn.Module]:
    """Replace every planned parameter by this rank's experts (a DTensor on the ep mesh); no communication.

    Every rank must hold the same full parameters beforehand (same seed, or the same checkpoint).
    """
    if not state.ep_enabled:
        return []
    check_ep(model, state)
    mesh = state.ep_mesh["ep"]
    modules = expert_modules(model)
    for module in modules:
        for attr in _planned(model, module):
            full = module._parameters[attr]
            local = full.detach().chunk(state.ep_size, dim=0)[state.ep_rank].clone()
            dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            module._parameters[attr] = nn.Parameter(dtensor, requires_grad=full.requires_grad)
        module.ep_sharded = True
    return modules


def _planned(model: nn.Module, module: nn.Module) -> list[str]:
    return sorted({suffix.rpartition(".")[2] for suffix in model._patchgen_ep_plan} & set(module._parameters))
