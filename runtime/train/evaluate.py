"""The eval set of text, VLM and omni runs (``eval: {path, every_steps, max_batches}``): the loss of a held-out file
every ``every_steps`` steps and at the end, comparable from one eval to the next.

* The file has ``data.path``'s format and is read, checked, tokenized and packed the same way (``data.token_budget``
  rows, samples without a target within the budget left out), but in file order: the rows are planned once, without
  shuffling, as one replica would see them, and row ``j`` goes to data-parallel replica ``j % dp_size``. Nothing is
  dropped: in the last round a replica without a row runs a copy of the first row with every label masked (it adds
  no token), so every rank runs the same forwards (FSDP2 gathers in each). ``max_batches`` keeps the first
  ``max_batches`` rounds (rows per replica).
* The value is the token-weighted mean cross-entropy over every evaluated target token of every rank, with the
  training loss's convention (``runtime/train/loop.py``): each forward gets the global target count as
  ``num_items_in_batch``, the SP group's share is summed over the data-parallel group. MoE load-balancing terms are
  left out. It runs under ``torch.no_grad`` with the model in eval mode (no dropout), then back to training mode.

DiTs have no eval set: the config refuses ``eval`` for them (their check is the validation samples, ``validation``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from runtime.config.errors import ConfigError
from runtime.data.samples import LocatedSample
from runtime.data.sp_batch import packed_attention_kwargs, shard_for_sp
from runtime.models.registry import lookup
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig
from runtime.train.text_step import document_masks, needs_documents

__all__ = ["TextEvaluator", "build_eval_loader", "eval_due", "read_eval_samples"]

IGNORE_INDEX = -100


def read_eval_samples(config: RunConfig) -> list[LocatedSample] | None:
    """The samples of ``eval.path`` (None without an eval set), checked as ``data.path`` is; errors name eval.path."""
    if config.eval.path is None:
        return None
    from runtime.train.preflight import check_data

    held_out = dataclasses.replace(config, data=dataclasses.replace(config.data, path=config.eval.path))
    try:
        return check_data(held_out)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError("eval.path:" + message.removeprefix("data.path:")) from None


def build_eval_loader(config: RunConfig, model: torch.nn.Module, processor: Any, samples: list[LocatedSample]) -> Any:
    """The packed loader of the eval samples (``runtime/train/data.py``'s, tokenized the same way), planned for one
    replica in file order; errors name eval.path."""
    from runtime.train.data import build_loader

    held_out = dataclasses.replace(config, data=dataclasses.replace(config.data, path=config.eval.path))
    try:
        return build_loader(held_out, ParallelState(), model, processor, samples, shuffle=False)
    except ConfigError as exc:
        raise ConfigError("eval.path:" + str(exc).removeprefix("data.path:")) from None


def eval_due(config: RunConfig, step: int) -> bool:
    """Whether the eval set is measured after ``step``: every ``eval.every_steps`` steps, and at the last step."""
    every = config.eval.every_steps
    return config.eval.path is not None and (step == config.train.steps or (every > 0 and step % every == 0))


def _target_count(row: dict[str, torch.Tensor]) -> int:
    return int((row["labels"][:, 1:] != IGNORE_INDEX).sum())


def _masked(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**row, "labels": torch.full_like(row["labels"], IGNORE_INDEX)}


def _sum_over(value: torch.Tensor, group: Any) -> torch.Tensor:
    if dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return value


class TextEvaluator:
    """``evaluator()``: the eval loss of ``model`` now (collective over every rank)."""

    def __init__(
        self, model: torch.nn.Module, loader: Any, state: ParallelState, config: RunConfig, device: torch.device
    ) -> None:
        """``loader``: a packed loader of the eval samples built for one replica without shuffling (its sampler's
        epoch-0 plan is every row of the file, in order)."""
        self.model, self.loader, self.state, self.config, self.device = model, loader, state, config, device
        plan = loader.sampler.rank_groups(0)
        dp = state.dp_size
        rounds = math.ceil(len(plan) / dp)
        if config.eval.max_batches is not None:
            rounds = min(rounds, config.eval.max_batches)
        self.plan = plan
        self.mine: list[tuple[int, ...] | None] = [
            plan[j] if (j := r * dp + state.dp_rank) < len(plan) else None for r in range(rounds)
        ]
        self.rows_evaluated = min(len(plan), rounds * dp)
        text = model.config.get_text_config()
        self.aux_coef = getattr(text, "router_aux_loss_coef", 0.0) if lookup(config.model.type).is_moe else 0.0
        self.varlen = text._attn_implementation.startswith("flash") or needs_documents(config)
        self.tokens: torch.Tensor | None = None

    def _row(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        return self.loader.pack([self.loader.samples[i] for i in indices])

    def _rows(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's rows, packed one at a time (a replica without a row in the last round: a masked copy)."""
        for indices in self.mine:
            yield self._row(indices) if indices is not None else _masked(self._row(self.plan[0]))

    def _tokens(self) -> torch.Tensor:
        """The target tokens of every evaluated row of every rank (counted once: the set does not change)."""
        if self.tokens is None:
            count = torch.tensor(sum(_target_count(row) for row in self._rows()), device=self.device)
            self.tokens = _sum_over(count, self.state.dp_group)
        return self.tokens

    @torch.no_grad()
    def __call__(self) -> float:
        model, state, device = self.model, self.state, self.device
        tokens = self._tokens()
        moe_kwargs = {"output_router_logits": True} if self.aux_coef else {}
        total = torch.zeros((), dtype=torch.float64, device=device)
        training = model.training
        model.eval()
        try:
            for row in self._rows():
                batch = shard_for_sp(row, state)
                if self.varlen:
                    batch.update(packed_attention_kwargs(batch["position_ids"]))
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                with document_masks(self.config):  # a model whose mask keeps documents apart only when told
                    out = model(
                        **batch,
                        num_items_in_batch=tokens,
                        loss_chunk_size=self.config.train.loss_chunk_size,
                        **moe_kwargs,
                    )
                aux = getattr(out, "aux_loss", None)
                share = out.loss.detach().double()
                if aux is not None and self.aux_coef:
                    share = share - self.aux_coef * aux.detach().double()
                total += share
        finally:
            model.train(training)
        return float(_sum_over(total, state.dp_group))
