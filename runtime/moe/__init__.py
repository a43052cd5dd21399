"""Mixture-of-experts runtime: one experts interface (eager reference, grouped, Triton), expert parallelism and the
global load-balancing loss. See ``runtime.moe.experts`` for the implementations, ``runtime.moe.sort`` and
``runtime.moe.grouped`` for the sorted layout and the grouped-matmul backends with their trade-offs."""

from runtime.moe.aux_loss import global_load_balancing_loss
from runtime.moe.ep import all_to_all_uneven, ep_experts_forward, local_expert_range
from runtime.moe.experts import IMPLS, experts_forward
from runtime.moe.grouped import GROUPED_BACKENDS, grouped_linear
from runtime.moe.sort import sort_by_expert

__all__ = [
    "GROUPED_BACKENDS",
    "IMPLS",
    "all_to_all_uneven",
    "ep_experts_forward",
    "experts_forward",
    "global_load_balancing_loss",
    "grouped_linear",
    "local_expert_range",
    "sort_by_expert",
]
