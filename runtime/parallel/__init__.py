"""Parallel core: the process layout (``state``), the SP collectives (``collectives``) and FSDP2 (``fsdp``)."""

from runtime.parallel.collectives import (
    gather_along_dim,
    gather_heads_scatter_seq,
    gather_seq_scatter_heads,
    pad_and_slice,
    reduce_token_weighted_loss,
    slice_for_rank,
    unpad,
)
from runtime.parallel.fsdp import apply_activation_checkpointing, apply_fsdp, clip_grad_norm_
from runtime.parallel.state import (
    ParallelState,
    get_parallel_state,
    init_parallel_state,
    parallel_state,
    set_parallel_state,
)

__all__ = [
    "ParallelState",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "clip_grad_norm_",
    "gather_along_dim",
    "gather_heads_scatter_seq",
    "gather_seq_scatter_heads",
    "get_parallel_state",
    "init_parallel_state",
    "pad_and_slice",
    "parallel_state",
    "reduce_token_weighted_loss",
    "set_parallel_state",
    "slice_for_rank",
    "unpad",
]
