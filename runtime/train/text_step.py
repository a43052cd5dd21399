"""One training step of the text, vision-language and omni models: packed rows, each rank's share of the global
token-weighted mean loss, and what names a step's samples when the non-finite guard stops it.

Its own module (the DiT family's is ``dit_step.py``) so that the shared loop (``loop.py``) and the start-up
self-check (``self_check_text.py``), which runs exactly this step on a shrunk copy of the job's model, import it
without importing each other.

Loss convention: every rank's loss is its share of the global token-weighted mean (the SP group's token losses
divided by the token count of the whole global batch, passed to the model as ``num_items_in_batch``), so gradients
summed over all ranks (FSDP configured to sum) are exactly the gradients of the global mean.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from runtime.data.sp_batch import packed_attention_kwargs, shard_for_sp
from runtime.models.registry import lookup
from runtime.parallel.state import ParallelState
from runtime.sp.positions import documents_from_position_ids
from runtime.train.config import RunConfig
from runtime.train.job import StepWork, all_reduce_sum, to_device, train_device
from runtime.train.metrics import step_flops

__all__ = [
    "IGNORE_INDEX",
    "describe_rows",
    "document_masks",
    "needs_documents",
    "sample_names",
    "states_documents",
    "target_count",
    "text_forward_backward",
]

# How a record states that the trainer must hand its model a packed row's documents: ``cu_seq_lens`` (the
# boundaries as flash's varlen kwargs, read by a recurrence), ``position_ids`` (the row's restarting position ids
# handed to mask builders that upstream's forward calls without them: gpt_oss).
BOUNDARIES = ("cu_seq_lens", "position_ids")

IGNORE_INDEX = -100


def target_count(rows: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Valid next-token targets in full (unsliced) rows: the denominator of the token-weighted mean."""
    return sum((row["labels"][:, 1:] != IGNORE_INDEX).sum() for row in rows)


def sample_names(samples: Sequence[Any]) -> list[str]:
    """Each located sample's ``file:line``; a text file's documents (all named by the file) by their number."""
    names = [s.where for s in samples]
    if len(set(names)) < len(names):
        names = [f"{name} document {index + 1}" for index, name in enumerate(names)]
    return names


def describe_rows(
    loader: Any, position: dict, count: int, names: Sequence[str] | None, dp_rank: int
) -> list[list[str]]:
    """The samples of the ``count`` rows ``loader`` handed out from ``position`` (its ``state_dict()`` then): the
    sampler is deterministic, so a copy of it replays them. Without ``names`` (the loader left samples out up front,
    so its indices are not the data file's), the rows' place in the data order."""
    sampler = copy.copy(loader.sampler)
    sampler.load_state_dict(position)
    rows = [next(sampler) for _ in range(count)]
    if names is None:
        epoch, first = position["epoch"], position["position"]
        return [[f"data row {first + i} of epoch {epoch} (data-parallel rank {dp_rank})"] for i in range(count)]
    return [[names[i] for i in row] for row in rows]


def needs_documents(config: RunConfig) -> bool:
    """Whether the model honours packed documents only when given the row's boundaries (its record's
    ``data.packed_documents``: a linear-attention layer's recurrence has no mask to read them from)."""
    return lookup(config.model.type).data.get("packed_documents") == "cu_seq_lens"


def states_documents(config: RunConfig) -> bool:
    """Whether the model's record states a way the trainer hands it a packed row's documents (``BOUNDARIES``)."""
    return lookup(config.model.type).data.get("packed_documents") in BOUNDARIES


def document_masks(config: RunConfig) -> AbstractContextManager[None]:
    """Where a forward's packed documents must be kept apart by the mask its model builds: for a record stating
    ``packed_documents = "position_ids"`` (upstream's mask lets them attend to each other) the context in which the
    row's position ids reach the mask builders, else nothing."""
    stated = lookup(config.model.type).data.get("packed_documents") == "position_ids"
    return documents_from_position_ids() if stated else nullcontext()


def text_forward_backward(
    model,
    loader,
    state: ParallelState,
    config: RunConfig,
    names: Sequence[str] | None = None,
    backward: bool = True,
) -> StepWork:
    """Packed rows: every rank's loss is its share of the global token-weighted mean (see the module docstring).
    ``backward=False``: the loss alone (the self-check's first look at a planted defect, under ``torch.no_grad``)."""
    position = loader.state_dict()
    rows = [next(loader) for _ in range(config.train.micro_batches)]
    micro_losses = []
    device = train_device(state)
    tokens = all_reduce_sum(target_count(rows).to(device), state.dp_group)  # NCCL reduces device tensors only
    loss_share, aux = torch.zeros((), device=device), torch.zeros((), device=device)
    # MoE: the load-balancing loss, asked for explicitly (some models read the switch only from forward kwargs,
    # others from a config flag a real checkpoint may leave off); its coefficient sits in the text config.
    moe = lookup(config.model.type).is_moe
    aux_coef = getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) if moe else 0.0
    moe_kwargs = {"output_router_logits": True} if aux_coef else {}
    varlen = model.config.get_text_config()._attn_implementation.startswith("flash") or needs_documents(config)
    for row in rows:
        batch = shard_for_sp(row, state)
        if varlen:  # the packed segments, computed here rather than by a device sync inside the forward
            batch.update(packed_attention_kwargs(batch["position_ids"]))  # multimodal: (4, bs, L), text row first
        with document_masks(config):
            out = model(
                **to_device(batch, device),
                num_items_in_batch=tokens,
                loss_chunk_size=config.train.loss_chunk_size,
                **moe_kwargs,
            )
        if backward:
            out.loss.backward()
        # MoE: the load-balancing term is the global value on every rank (not a share); report it once.
        row_aux = getattr(out, "aux_loss", None)
        row_aux = torch.zeros((), device=device) if row_aux is None else aux_coef * row_aux.detach()
        loss_share += out.loss.detach() - row_aux
        aux += row_aux / len(rows)
        micro_losses.append(out.loss.detach())
    loss = all_reduce_sum(loss_share, state.dp_group) + aux  # SP ranks already agree; DP shares add up
    # the real tokens and model FLOPs of every DP replica's rows (each packed document attends only to itself)
    text_config = model.config.get_text_config()
    mine = [sum(row["input_ids"].numel() for row in rows), step_flops(text_config, rows)]
    processed, flops = all_reduce_sum(torch.tensor(mine, dtype=torch.float64, device=device), state.dp_group).tolist()
    return StepWork(
        loss=loss,
        count=int(tokens),
        processed=int(processed),
        flops=flops,
        micro_losses=micro_losses,
        describe=lambda: describe_rows(loader, position, len(rows), names, state.dp_rank),
    )
