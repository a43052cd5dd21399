"""Our experts kernels, registered in transformers' ExpertsInterface (`experts_implementation=...`).

Generated MoE models keep upstream's experts class, whose forward dispatches on `config._experts_implementation`.
`patchgen_grouped` (sorted tokens + grouped matmuls) and `patchgen_triton` (GPU) are the training kernels; both
run expert parallelism when the experts were sharded by `runtime.parallel.expert_parallel.apply_ep`. `eager` stays
upstream's own loop: the numerical reference and the parity baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from runtime.moe.ep import ep_experts_forward
from runtime.moe.experts import experts_forward
from runtime.parallel.state import get_parallel_state

KERNELS = {"patchgen_grouped": "grouped", "patchgen_triton": "triton"}


def _local(param: torch.Tensor) -> torch.Tensor:
    """Expert-parallel parameters are DTensors sharded over the ep mesh; kernels work on this rank's experts."""
    return param.to_local() if isinstance(param, DTensor) else param


def _experts_kernel(impl: str) -> Callable[..., torch.Tensor]:
    def forward(
        module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
        if getattr(module, "ep_sharded", False):
            return ep_experts_forward(
                hidden_states,
                top_k_index,
                top_k_weights,
                gate_up,
                down,
                module.act_fn,
                module.num_experts,
                get_parallel_state().ep_group,
                impl=impl,
            )
        return experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            gate_up,
            down,
            module.act_fn,
            impl=impl,
            num_experts=module.num_experts,
        )

    forward.__name__ = f"{impl}_experts_forward"
    return forward


def check_ep_kernel(model: torch.nn.Module) -> None:
    """Expert parallelism needs one of our kernels: upstream's experts loop knows nothing of sharded experts."""
    register_experts_kernels()
    impl = getattr(model.config, "_experts_implementation", None)
    if impl not in KERNELS:
        raise ValueError(f"expert parallelism needs experts_implementation in {sorted(KERNELS)}, found {impl!r}")


def register_experts_kernels() -> None:
    """Idempotent; call before building a model with `experts_implementation='patchgen_grouped'`."""
    for name, impl in KERNELS.items():
        if name not in ALL_EXPERTS_FUNCTIONS:
            ExpertsInterface.register(name, _experts_kernel(impl))


register_experts_kernels()
