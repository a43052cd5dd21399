"""Our experts kernels, registered in transformers' ExpertsInterface (`experts_implementation=...`).

Generated MoE models keep upstream's experts class, whose forward dispatches on `config._experts_implementation`.
`patchgen_grouped` (sorted tokens + grouped matmuls) and `patchgen_triton` (GPU) are the training kernels; both
run expert parallelism when the experts were sharded by `runtime.parallel.expert_parallel.apply_ep`. They compute
transformers' default experts layout only. `patchgen_eager` computes any layout the experts class declares to
``use_experts_implementation`` (biases, transposed weights, interleaved gate/up, its own ``_apply_gate`` such as
gpt_oss's clamped SwiGLU; transformers' ``grouped_mm`` over the module's own flags and methods: tokens sorted by
expert, no per-token copy of the weights) and runs expert
parallelism too: the way to train such experts sharded. `eager` stays upstream's own loop: the numerical
reference and the parity baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    ExpertsInterface,
    _default_apply_gate,
    grouped_mm_experts_forward,
)

from runtime.config.errors import LayoutRefused
from runtime.moe.ep import ep_experts_forward
from runtime.moe.experts import experts_forward
from runtime.parallel.state import get_parallel_state

KERNELS = {"patchgen_grouped": "grouped", "patchgen_triton": "triton"}  # the fused kernels: default layout only
LAYOUT_KERNEL = "patchgen_eager"  # any declared layout, with expert parallelism


def _local(param: torch.Tensor) -> torch.Tensor:
    """Expert-parallel parameters are DTensors sharded over the ep mesh; kernels work on this rank's experts."""
    return param.to_local() if isinstance(param, DTensor) else param


# The one weight layout our kernels compute (``runtime/moe/experts.py``): transformers' default experts layout.
KERNEL_PARAMETERS = frozenset({"gate_up_proj", "down_proj"})
_LAYOUT_CHECKED = "_patchgen_expert_layout_checked"


def expert_layout_problem(module: torch.nn.Module) -> str | None:
    """What in ``module`` (an experts module of transformers' ``use_experts_implementation``) our kernels would not
    compute, or None. Its class states its layout (``has_bias``, ``is_transposed``, ``is_concatenated``,
    ``has_gate``, an own ``_apply_gate``) and its parameters show it; anything but concatenated gate/up rows, no
    biases, the (E, out, in) orientation and ``act(gate) * up`` would be silently dropped or misread."""
    found = []
    extra = sorted({name for name, _ in module.named_parameters(recurse=False)} - KERNEL_PARAMETERS)
    if getattr(module, "has_bias", False) or any(name.endswith("bias") for name in extra):
        found.append("expert biases")
    if getattr(module, "is_transposed", False):
        found.append("transposed (E, in, out) weights")
    if not getattr(module, "is_concatenated", True):
        found.append("interleaved gate/up rows")
    if not getattr(module, "has_gate", True):
        found.append("ungated experts (up_proj only)")
    if type(module)._apply_gate is not _default_apply_gate:
        found.append(f"its own gate activation ({type(module).__name__}._apply_gate, e.g. a clamp)")
    if extra and not found:
        found.append(f"parameters {extra}")
    if not found:
        return None
    return (
        f"{type(module).__name__} has {', '.join(found)}, which the fused expert kernels (experts_implementation "
        f"{sorted(KERNELS)}) do not compute; use model.experts_implementation: {LAYOUT_KERNEL} (the module's own "
        f"layout, expert parallelism too) or eager (upstream's loop; no expert parallelism)"
    )


def check_expert_layouts(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when the model runs one of our kernels on experts whose layout they do not compute."""
    for module in model.modules():
        if hasattr(module, "has_gate") and getattr(module.config, "_experts_implementation", None) in KERNELS:
            problem = expert_layout_problem(module)
            if problem is not None:
                raise ValueError(problem)


def _experts_kernel(impl: str) -> Callable[..., torch.Tensor]:
    def forward(
        module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not module.__dict__.get(_LAYOUT_CHECKED):  # once per module, not on every call of the hot path
            problem = expert_layout_problem(module)  # a layout the kernels misread must never run
            if problem is not None:
                raise LayoutRefused(problem)
            module.__dict__[_LAYOUT_CHECKED] = True
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


class _LocalExperts:
    """An experts module as transformers' ``grouped_mm`` must see it: this rank's shard of every parameter (local
    expert ids), the module's own flags and gate (``_apply_gate`` stays bound to the module: its clamp, ``alpha``)."""

    def __init__(self, module: torch.nn.Module, num_experts: int) -> None:
        self._module, self.num_experts = module, num_experts

    def __getattr__(self, name: str) -> object:
        value = getattr(self._module, name)
        return _local(value) if isinstance(value, torch.Tensor) else value


def _layout_kernel(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``patchgen_eager``: the module's own layout (transformers' ``grouped_mm`` over its flags), sharded or not."""
    local = _local(module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj)
    view = _LocalExperts(module, local.size(0))

    def compute(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped_mm_experts_forward(view, hidden, index, weights)

    if not getattr(module, "ep_sharded", False):
        return compute(hidden_states, top_k_index, top_k_weights)
    down = _local(module.down_proj)
    return ep_experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        local,
        down,
        None,
        module.num_experts,
        get_parallel_state().ep_group,
        compute=compute,
    )


def check_ep_kernel(model: torch.nn.Module) -> None:
    """Expert parallelism needs one of our kernels: upstream's experts loop knows nothing of sharded experts."""
    register_experts_kernels()
    impl = getattr(model.config, "_experts_implementation", None)
    if impl not in KERNELS and impl != LAYOUT_KERNEL:
        raise ValueError(
            f"expert parallelism needs experts_implementation in {sorted([*KERNELS, LAYOUT_KERNEL])}, found {impl!r}"
        )


def register_experts_kernels() -> None:
    """Idempotent; call before building a model with `experts_implementation='patchgen_grouped'`."""
    for name, impl in KERNELS.items():
        if name not in ALL_EXPERTS_FUNCTIONS:
            ExpertsInterface.register(name, _experts_kernel(impl))
    if LAYOUT_KERNEL not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(LAYOUT_KERNEL, _layout_kernel)


register_experts_kernels()
