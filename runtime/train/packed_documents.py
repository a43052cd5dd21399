"""Packed rows through a model whose sequence mixers carry state across positions, or whose attention mask lets
packed documents see each other: refused at start-up unless the model's record states how the row's document
boundaries reach them.

The token trainer packs several documents into one row (``runtime/data/text/packing.py``). Attention keeps them
apart through the packing mask the generated models build from the restarting position ids, but a mixer that
carries state along the row (a linear-attention recurrence, a causal convolution, a state-space scan) has no mask
to read: without the row's boundaries each document is trained on the tail of the previous one, and the run trains
wrong numbers with exit 0. A model whose spec states ``[model.data] packed_documents = "cu_seq_lens"`` is given
the boundaries on every packed row (``runtime/train/text_step.py``); any other is probed here before it trains.
The same holds for attention whose mask builders never see the position ids (upstream's gpt_oss forward calls them
without): its mask is causal over the whole row, and ``packed_documents = "position_ids"`` states that the trainer
hands them over (``runtime.sp.positions.documents_from_position_ids``).

The probe is behavioural, not a list of class names, so it holds for a model the project has never seen: the job's
config shrunk as the self-check shrinks it (one process), run twice on one packed row whose earlier documents'
tokens differ between the runs, the row's boundaries passed as the trainer passes them. Every module's output at
the last document's positions must stay put (a per-token module, masked attention); the first module in run order
whose output there moves is the leak, named by the mixer of its block that holds it. ``MOVED`` sits orders of
magnitude above rounding (a batched kernel's blocking) and below an O(1) change (``tests/models/mixers.py``). A job
on flash attention is given the row's boundaries as varlen kwargs, which the CPU probe's attention cannot read:
there only a leak outside attention counts.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import nn

from runtime.config.errors import ConfigError
from runtime.data.sp_batch import packed_attention_kwargs
from runtime.models.registry import GeneratedModel
from runtime.parallel.fsdp import block_modules
from runtime.parallel.sites import attention_modules
from runtime.parallel.state import ParallelState, parallel_state
from runtime.sp.positions import documents_from_position_ids

__all__ = ["MOVED", "Leak", "check_packed_documents", "leaking_mixer"]

MOVED = 1e-3  # relative change at the last document's positions that counts as a leak (module docstring)
STATED = "cu_seq_lens"  # a recurrence's boundaries: the trainer passes cu_seq_lens_q/k
MASKED = "position_ids"  # an attention mask's documents: the trainer hands the position ids to the mask builders


class Leak(NamedTuple):
    """Where a packed row's earlier documents reach its last one: the mixer (path and class), and whether it is
    softmax attention (its mask) rather than a carried state."""

    mixer: str
    attention: bool


def _token_dim(tensor: torch.Tensor, length: int) -> int | None:
    """The dimension that holds the row's positions: the first past the batch whose size is the row's length."""
    return next((d for d in range(1, tensor.dim()) if tensor.shape[d] == length), None)


def _first_tensor(output: Any) -> torch.Tensor | None:
    if torch.is_tensor(output):
        return output
    if hasattr(output, "to_tuple"):  # a transformers ModelOutput
        output = output.to_tuple()
    if isinstance(output, tuple | list):
        return next((o for o in output if torch.is_tensor(o)), None)
    return None


def _outputs(model: nn.Module, batch: dict[str, Any], length: int) -> list[tuple[tuple[str, int], torch.Tensor]]:
    """Every module call's first tensor output that holds the row's positions, in the order the calls finished,
    each keyed by the module's path and its call count (a module may run more than once per forward)."""
    found: list[tuple[tuple[str, int], torch.Tensor]] = []
    calls: dict[str, int] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            calls[name] = calls.get(name, 0) + 1
            if tensor is not None and tensor.is_floating_point() and _token_dim(tensor, length) is not None:
                found.append(((name, calls[name]), tensor.detach().float().clone()))

        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _mixer(model: nn.Module, path: str) -> str:
    """``path`` as the mixer of the block holding it (``model.layers.0.linear_attn``)."""
    modules = dict(model.named_modules())
    try:
        blocks = {id(b) for b in block_modules(model)}
    except ValueError:
        blocks = set()
    block_paths = [name for name, m in modules.items() if id(m) in blocks and path.startswith(name + ".")]
    if block_paths:
        block = max(block_paths, key=len)
        path = f"{block}.{path[len(block) + 1 :].split('.')[0]}"
    return path


def leaking_mixer(model: nn.Module, row: dict[str, torch.Tensor], stated: str | None) -> Leak | None:
    """The mixer through which a packed row's earlier documents reach its last one, or None. ``row``: one packed
    row (``input_ids`` and restarting ``position_ids``); ``stated``: the record's ``packed_documents``, the row's
    documents handed over as the trainer hands them for it."""
    positions = row["position_ids"][0] if row["position_ids"].dim() == 3 else row["position_ids"]  # M-RoPE: text
    length = positions.shape[-1]
    last = int(torch.nonzero(positions[0] == 0).flatten()[-1])
    other = dict(row, input_ids=row["input_ids"].clone())
    other["input_ids"][:, :last] = row["input_ids"][:, :last].roll(1, dims=1)  # earlier documents' tokens moved
    attention = [path for path, _ in attention_modules(model)]
    extra = packed_attention_kwargs(row["position_ids"]) if stated == STATED else {}
    model.eval()
    with documents_from_position_ids() if stated == MASKED else nullcontext():
        first = _outputs(model, {**row, **extra}, length)
        second = dict(_outputs(model, {**other, **extra}, length))
    for (name, call), tensor in first:
        moved = second.get((name, call))
        if moved is None or moved.shape != tensor.shape:
            continue
        dim = _token_dim(tensor, length)
        here, there = tensor.narrow(dim, last, length - last), moved.narrow(dim, last, length - last)
        scale = here.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        if ((here - there).abs().max() / scale) > MOVED:
            mixer = _mixer(model, name)
            masked = any(p == a or p.startswith(a + ".") for p in (mixer, name) for a in attention)
            return Leak(f"{mixer} ({type(model.get_submodule(mixer)).__name__})", masked)
    return None


def check_packed_documents(entry: GeneratedModel, job_config: Any, model_class: type | None = None) -> None:
    """Refuse (``ConfigError``, one line) a packed-rows job of ``entry``'s model whose sequence mixers carry state
    from one packed document into the next, or whose attention lets one see another (the module docstring).
    ``job_config``: the built model's config; ``model_class`` replaces the registry's class (a copy of a spec
    regenerated elsewhere)."""
    from runtime.train.self_check_text import model_reads, proof_rows, shrunk_text_config

    model_class = model_class or entry.model_class()
    stated = entry.data.get("packed_documents")
    # one process on the CPU, its own weights and tokens: the job's random streams continue as if it had not run
    with parallel_state(ParallelState()), torch.random.fork_rng(devices=[]):
        shrunk = shrunk_text_config(job_config, ParallelState(), model_reads(model_class))
        varlen = shrunk._attn_implementation.startswith("flash")  # the trainer passes the boundaries to attention
        if shrunk._attn_implementation not in ("eager", "sdpa"):  # a GPU kernel: the probe runs on the CPU
            shrunk._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
        if entry.is_moe:
            shrunk._experts_implementation = "eager"  # the reference experts: per-token, on any device
        torch.manual_seed(0)
        model = model_class(shrunk)
        (row,) = proof_rows(1, shrunk, entry.is_vlm)
        row = {k: v for k, v in row.items() if k != "labels"}
        leak = leaking_mixer(model, row, stated)
    if leak is None or (leak.attention and varlen):
        return
    name = f"model.type: {entry.model_type}: {leak.mixer}"
    if leak.attention:
        given = " even given the row's position ids" if stated == MASKED else ""
        fix = (
            "its mask builders must read the position ids"
            if stated == MASKED
            else f'state in spec {entry.spec!r} how its mask learns them ([model.data] packed_documents = "{MASKED}": '
            "the trainer hands the row's position ids to its mask builders)"
        )
        raise ConfigError(f"{name} lets one packed document attend to the others{given}; {fix}")
    if stated == STATED:
        raise ConfigError(
            f"{name} carries state from one packed document into the next even given the row's boundaries "
            f"(cu_seq_lens_q/k): its patches must restart it at them"
        )
    raise ConfigError(
        f"{name} carries state from one packed document into the next, and the trainer packs several documents per "
        f"row; state the boundaries in spec {entry.spec!r} "
        f'([model.data] packed_documents = "{STATED}", with patches that restart the mixer at cu_seq_lens_q)'
    )
