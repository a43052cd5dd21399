"""The start-up self-check of language models: text models (``causal_lm``), and vision-language and omni models on
text-only rows (their language model, and every rank's FSDP dummy forward of the towers); ``runtime/train/
self_check.py`` says why and what it compares.

The proof's batch: one packed row per data-parallel replica (several documents each, of lengths that leave SP
padding to add and exceed the shrunk window), exactly as the trainer's loader hands them out. The job's side runs
the trainer's own step (``text_forward_backward``: ``shard_for_sp``, the global token count as
``num_items_in_batch``, the job's ``loss_chunk_size`` and MoE load-balancing switch) on a model made ready by the
job's ``parallelize``. The reference runs every replica's row in turn (gradients accumulated, the global token
count as ``num_items_in_batch``: the job's loss), in one process, fp32, with the generated class, so that a layer
carrying state along a row never sees another replica's tokens; with a MoE load-balancing loss on (a statistic of
the whole batch) and for vision-language and omni models (upstream keeps its M-RoPE deltas between calls) the rows
run concatenated into one packed row (documents stay apart: position ids restart, and no label crosses a row). The
upstream class runs the same rows with the same weights. A model whose layers keep packed documents apart only when
given the row's boundaries (a linear-attention recurrence: its record's ``data.packed_documents``) gets them in the
trainer's step, so the layout is compared with the reference run again with them (upstream's torch path reads none:
the generated class is compared with it without them).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
from contextlib import nullcontext
from typing import Any

import torch
import transformers

from runtime.data.sp_batch import packed_attention_kwargs
from runtime.models.registry import lookup
from runtime.models.tiny_configs import random_packed_batch
from runtime.parallel.mixers import census
from runtime.parallel.parallelize import parallelize
from runtime.parallel.precision import compute_dtype
from runtime.parallel.state import ParallelState, parallel_state
from runtime.train.config import RunConfig
from runtime.train.job import parallel_plan, to_device, train_device
from runtime.train.self_check import Comparison, Proof, compare, gradients, layout_text, tolerance
from runtime.train.self_check_power import (
    binding_softcaps,
    handled_defects,
    long_memory,
    planted_run,
    text_defects,
)
from runtime.train.self_check_shrink import (
    ShrinkLayout,
    config_reads,
    crossed_thresholds,
    is_token_id,
    shrink_values,
)
from runtime.train.self_check_vision import concatenated, with_image
from runtime.train.text_step import (
    document_masks,
    needs_documents,
    states_documents,
    target_count,
    text_forward_backward,
)
from runtime.vlm.dummy_forward import towers_uniform

__all__ = ["DOCUMENTS", "prove_text", "proof_rows", "shrunk_text_config"]

# Documents of replica d's row: d + DOCUMENTS[i]; 23 + d tokens (odd for d = 0, so SP pads), the longest past the
# shrunk window (capped at a quarter of ROW_LENGTH, or the tiny config's window).
DOCUMENTS = (7, 11, 5)
ROW_LENGTH = sum(DOCUMENTS)
SEED = 1234  # the proof's own weights and tokens (the job's random streams are untouched)


def model_reads(model_class: type) -> frozenset[str]:
    """The config keys the code of ``model_class``'s module reads (``self_check_shrink.config_reads``)."""
    module = sys.modules.get(model_class.__module__)
    try:
        return config_reads(inspect.getsource(module)) if module is not None else frozenset()
    except (OSError, TypeError):  # a module without a source file: nothing found, nothing capped
        return frozenset()


def shrunk_text_config(
    job_config: transformers.PretrainedConfig, state: ParallelState, reads: frozenset[str] = frozenset()
) -> Any:
    """The job's config shrunk by ``self_check_shrink``'s rule, with the job's attention and experts kernels. The
    language model's heads fit the Ulysses degree, a tower's (vision, audio) sp: towers run Ulysses over all of SP.
    ``reads``: the config keys the model's code reads (its thresholds are brought into the proof's rows)."""
    entry = lookup(job_config.model_type)
    layout = ShrinkLayout(ep_size=state.ep_size, head_split=state.ulysses_size, row_length=ROW_LENGTH, reads=reads)
    towers = ShrinkLayout(state.ep_size, state.sp_size, ROW_LENGTH, reads, tower=True)
    subs = tuple(job_config.sub_configs)
    sub_layouts = {name: layout if name == "text_config" else towers for name in subs}
    values = shrink_values(job_config.to_dict(), entry.tiny, layout, sub_layouts, sub_configs=subs)
    config = transformers.AutoConfig.for_model(job_config.model_type, **{**values, "use_cache": False})
    config.get_text_config().use_cache = False  # training: no KV cache (as build_model sets it)
    config._attn_implementation = job_config._attn_implementation
    experts = getattr(job_config, "_experts_implementation", None)
    if entry.is_moe and experts is not None:
        config._experts_implementation = experts
    return config


def proof_rows(
    replicas: int, config: Any, multimodal: bool, model: torch.nn.Module | None = None
) -> list[dict[str, torch.Tensor]]:
    """One packed row per data-parallel replica, different lengths and tokens for each, of text tokens (below
    every special token id). A vision-language or omni row is laid out as its data path lays out a text-only
    sample: M-RoPE position ids ``(4, 1, L)`` (every channel the text positions) and text token types; with
    ``model`` (a vision-language model), even replicas' rows end with an image sample (``self_check_vision.py``)."""
    table = text_tokens(config)
    rows = []
    for d in range(replicas):
        row = random_packed_batch(tuple(n + d for n in DOCUMENTS), len(table) + 1, seed=SEED + d)
        row["input_ids"] = table[row["input_ids"] - 1]  # draws 1..len(table), as the row's labels
        row["labels"] = torch.where(row["labels"] < 0, row["labels"], row["input_ids"])
        rows.append(row)
    if multimodal:
        for row in rows:
            row["position_ids"] = row["position_ids"][None].expand(4, -1, -1).clone()
            row["mm_token_type_ids"] = torch.zeros_like(row["input_ids"], dtype=torch.int32)
    if model is not None:
        rows = [with_image(row, config, model, SEED + d) if d % 2 == 0 else row for d, row in enumerate(rows)]
    return rows


# A special token id below this sits at the bottom of the vocabulary (bos 1, eos 2, pad 0: Mistral, Gemma2), one at
# or above it at its top, above the text tokens (a vision-language model's image and video tokens)
LOW_SPECIAL = 32


def text_tokens(config: Any) -> torch.Tensor:
    """The ids a proof row draws its text tokens from: every id of the vocabulary but 0, the special token ids at
    its bottom and everything from the lowest special id at its top. Drawing only below the lowest special id would
    leave one token where bos and eos are 1 and 2 (every position the same: attention over equal values is the
    same whatever keys it sees, so a local site or a wrong position moves nothing and the proof has no power)."""
    specials = set()
    for key, value in config.to_dict().items():
        if is_token_id(key):
            specials |= {v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)}
    top = min([config.get_text_config().vocab_size, *(v for v in specials if v >= LOW_SPECIAL)])
    return torch.tensor([t for t in range(1, top) if t not in specials])


class _Rows:
    """The loader ``text_forward_backward`` pulls from: this replica's proof row, no data position."""

    def __init__(self, row: dict[str, torch.Tensor]) -> None:
        self.row = row

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.row

    def state_dict(self) -> dict:
        return {}


def _summary(config: Any) -> str:
    text = config.get_text_config()
    parts = [f"{text.num_hidden_layers} layers", f"hidden {text.hidden_size}"]
    vision = getattr(config, "vision_config", None)
    parts += [f"vision depth {vision.depth}"] if vision is not None and hasattr(vision, "depth") else []
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    return ", ".join(parts + ([f"{experts} experts"] if experts else []))


def prove_text(
    config: RunConfig,
    state: ParallelState,
    job_config: transformers.PretrainedConfig,
    model_class: type | None = None,
    upstream_class: type | None = None,
) -> Proof:
    """The proof of a language-model job (text, vision-language, omni; the module docstring). ``model_class`` /
    ``upstream_class`` replace the registry's classes (tests plant defects through them)."""
    entry = lookup(config.model.type)
    model_class = model_class or entry.model_class()
    upstream_class = upstream_class or entry.upstream_class()
    reads = model_reads(model_class)
    shrunk = shrunk_text_config(job_config, state, reads)
    job_text, shrunk_text = job_config.get_text_config().to_dict(), shrunk.get_text_config().to_dict()
    crossed = crossed_thresholds(job_text, shrunk_text, ShrinkLayout(reads=reads))
    device = train_device(state)
    torch.manual_seed(SEED)
    model = model_class(shrunk)
    rows = proof_rows(state.dp_size, shrunk, entry.is_vlm, model if entry.family == "vlm" else None)
    softcaps = binding_softcaps(model, shrunk, rows[0], reads)
    if softcaps:  # the same weights, built with the caps that bind (a module may copy its cap in __init__)
        torch.manual_seed(SEED)
        model = model_class(shrunk)
    memory = long_memory(model)  # before the copies: every side runs the same weights
    initial = {key: value.detach().clone() for key, value in model.state_dict().items()}  # upstream loads these
    reference = copy.deepcopy(model)
    plan = parallel_plan(config)
    dtype = compute_dtype(plan.mixed_precision, state.device_type)
    comparisons: list[Comparison] = []

    aux_coef = getattr(shrunk.get_text_config(), "router_aux_loss_coef", 0.0) if entry.is_moe else 0.0
    moe_kwargs = {"output_router_logits": True} if aux_coef else {}
    # A text model runs every replica's row in turn, gradients accumulated: a layer that carries state along a row
    # (a recurrence) must not see another replica's tokens. One packed row (documents stay apart) with a MoE
    # load-balancing loss (a statistic of the whole batch) and for vision-language models (upstream keeps its
    # M-RoPE deltas from one call to the next).
    apart = entry.family == "causal_lm" and not aux_coef
    batches = [to_device(row, device) for row in rows] if apart else [to_device(concatenated(rows), device)]
    count = target_count(rows).to(device)

    def run(model: torch.nn.Module, documents: bool = False) -> torch.Tensor:
        losses = []
        for batch in batches:
            varlen = documents and needs_documents(config)  # else the documents reach the mask builders
            bounds = to_device(packed_attention_kwargs(batch["position_ids"]), device) if varlen else {}
            with document_masks(config) if documents else nullcontext():
                out = model(**batch, **bounds, num_items_in_batch=count, **moe_kwargs)
            out.loss.backward()
            losses.append(out.loss.detach())
        return torch.stack(losses).sum()

    handled = handled_defects(shrunk, list(entry.supports.handles))
    planted: list[Comparison] = []
    advisory: dict[str, str] = {}
    fp32 = tolerance(torch.float32)
    with parallel_state(ParallelState()):  # one process, fp32, the generated class: the reference
        reference.to(device).train()
        if state.sp_enabled:  # the sequence mixers the layout's site check watches (whatever their class name)
            length = batches[0]["input_ids"].shape[1] if entry.family == "causal_lm" else None
            mixers = census(reference, functools.partial(reference, **batches[0], **moe_kwargs), length)
            plan = dataclasses.replace(plan, mixer_classes=mixers)
        ref_loss = run(reference)
        ref_grads = gradients(reference)
        upstream = upstream_class.from_config(shrunk, attn_implementation=shrunk._attn_implementation)
        upstream.load_state_dict(initial)
        upstream.to(device).train()
        what = f"generated vs upstream {entry.upstream_auto} (one process, fp32)"
        up_loss, up_grads = run(upstream), gradients(upstream)
        comparisons.append(compare(what, up_loss, up_grads, ref_loss, ref_grads, fp32))
        if state.world_size == 1:  # no layout: a handled option skipped shows against upstream
            for defect in handled:
                reference.zero_grad(set_to_none=True)
                with defect.plant(reference):
                    loss = run(reference)
                planted.append(compare(defect.name, loss, gradients(reference), up_loss, up_grads, fp32))
        if states_documents(config) and state.world_size > 1:  # the layout's step passes the rows' documents
            reference.zero_grad(set_to_none=True)
            ref_loss = run(reference, documents=True)
            ref_grads = gradients(reference)
    del reference, upstream

    if state.world_size > 1:  # the job's layout against one process
        model = parallelize(model, state, plan, device)
        model.train()
        step_config = dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batches=1))

        # every rank's row holds the same media (the rows are built alike on every rank): a forward without
        # gradients (a planted defect's first look) runs no dummy tower pass (``towers_uniform``: the loss is
        # bitwise the same; for the omni thinker's text-only rows three tower passes fewer per look)
        uniform = len({tuple(sorted(row)) for row in rows}) == 1

        def step(backward: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            model.zero_grad(set_to_none=True)
            with towers_uniform() if uniform and not backward else nullcontext():
                work = text_forward_backward(model, _Rows(rows[state.dp_rank]), state, step_config, backward=backward)
            return work.loss, gradients(model) if backward else {}

        layout = layout_text(state, plan.mixed_precision, dtype, plan.activation_checkpointing)
        comparisons.append(compare(f"{layout} vs one process", *step(), ref_loss, ref_grads, tolerance(dtype)))
        defects = text_defects(state, model) + handled
        advisory.update({d.name: d.advisory for d in defects if d.advisory})
        for defect in defects:
            planted.append(planted_run(defect, model, step, ref_loss, ref_grads, tolerance(dtype), state.loss_group))
    summary = _summary(shrunk) + (f", thresholds inside its rows: {', '.join(crossed)}" if crossed else "")
    summary += f", softcaps set to bind: {', '.join(softcaps)}" if softcaps else ""
    summary += f", recurrences set to remember: {', '.join(memory)}" if memory else ""
    return Proof(summary, comparisons, planted, advisory, plan.mixer_classes)
