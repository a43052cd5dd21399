"""The self-check's own power: before it reports "passed", the proof shows it would have failed. Each defect class
the job's layout can suffer is planted in turn into the shrunk model's run under that layout (the model's weights are
untouched; only the run is made defective), and the planted run must land outside the tolerance like a real defect.
A planted defect that stays inside it means the proof's inputs cannot tell the defect from a correct run on this
job (a row too short for a position offset to matter, a value regime where a branch does nothing): the run is
refused, naming what the proof could not reach (``self_check.report``).

The classes, each planted only where the layout has the parallelism it concerns:

- ``one attention site attends to its rank's tokens only`` (SP): the first attention call of the forward runs on
  this rank's tokens (text: the registered Ulysses / USP implementation swapped for the local inner one, its mask
  cut to the rank's block; DiT: ``self_check_power_dit``, one class per kind of SP site the model has);
- ``positions restart at the shard boundary`` (SP): the rank computes positions from its own tokens (text: the
  document crossing into the shard restarts at 0; DiT: every rank takes the first shard's RoPE tables);
- ``one linear-attention site runs on its rank's tokens only``, ``one convolution sees no neighbouring tokens``
  (SP, where the model has those sites: a gated delta-net's recurrence and short convolution,
  ``sp/linear_attention_*``; a DiT's linear attention and grid convolution): the first such site runs upstream's
  call on the rank's tokens;
- ``a replica's gradient share counted twice`` (data parallel): the last replica's loss doubled before backward,
  as a sum where a mean was meant;
- ``handled option <key> skipped`` (a ``[model] handles`` key the job sets): the option turned off in the planted
  run, as a patch that dropped upstream's branch without re-implementing it.

Why planted per job and not once in the suite: whether a defect shows depends on the job's own config (a softcap of
30 on logits of 1e-1 never binds; a position floor of 8192 is never reached by a 24-token row), which is exactly what
the suite cannot know.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_utils import AttentionInterface

from runtime.parallel.sites import mark_site
from runtime.parallel.state import ParallelState, parallel_state
from runtime.train.self_check import Comparison, agree, compare, relative

__all__ = [
    "DOUBLED_SHARE",
    "LOCAL_ATTENTION",
    "LOCAL_CONVOLUTION",
    "LOCAL_LINEAR_ATTENTION",
    "long_memory",
    "LOCAL_POSITIONS",
    "Defect",
    "FirstSite",
    "binding_softcaps",
    "imported_by",
    "swapped",
    "handled_defects",
    "planted_run",
    "planted_swap",
    "text_defects",
]

LOCAL_ATTENTION = "one attention site attends to its rank's tokens only"
LOCAL_POSITIONS = "positions restart at the shard boundary"
DOUBLED_SHARE = "a replica's gradient share counted twice"
LOCAL_LINEAR_ATTENTION = "one linear-attention site runs on its rank's tokens only"
LOCAL_CONVOLUTION = "one convolution sees no neighbouring tokens"
# A recurrence's memory is set by its weights: at random init a gated delta-net's decays forget within a few tokens,
# and a recurrence left local moved Qwen3-Next at ring 2 by 3e-5, inside the fp32 tolerance. ``long_memory`` sets
# the decays it can name (``A_log``) to remember across the proof's rows; a recurrence whose decay it cannot name
# stays advisory: not detecting it is said in the line, never a refusal of a correct run.
RECURRENCE = "a recurrence's memory is set by its weights, which forget within a few tokens at random init"
# exp(A_log) = 1e-2: with softplus(a + dt_bias) about 1 at init, a decay of about 0.99 per token (a memory of ~100
# tokens, past the proof's rows), where random init's A in (0, 16) forgets within a few tokens
LONG_MEMORY_A_LOG = math.log(1e-2)


def long_memory(model: torch.nn.Module) -> list[str]:
    """Every recurrence decay ``model`` names ``A_log`` (the log decay rate of gated delta-net and state-space
    layers, Mamba's and FLA's convention: ``g = -exp(A_log) * softplus(...)``) set to ``LONG_MEMORY_A_LOG``, in
    place, so that the state carries across the proof's rows and a recurrence left local shows; "A_log -> 1e-2" per
    parameter name pattern set (the start-up line)."""
    changed = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rpartition(".")[2] == "A_log":
                param.fill_(LONG_MEMORY_A_LOG)
                changed.add("A_log")
    return [f"{name} -> log 1e-2" for name in sorted(changed)]


@dataclass(frozen=True)
class Defect:
    """A defect class and how to plant it: ``plant(model)`` is a context manager within which the job's step on
    ``model`` is defective."""

    name: str
    plant: Callable[[torch.nn.Module], AbstractContextManager[Any]]
    advisory: str = ""  # why the proof cannot set the regime where this class shows: not detecting it is only said


@contextmanager
def swapped(name: str, real: Callable[..., Any], planted: Callable[..., Any]) -> Iterator[None]:
    """``name`` rebound to ``planted`` in every loaded module that imported ``real`` under it (the generated
    modules import the runtime's functions by name)."""
    holders = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get(name) is real]
    try:
        for module in holders:
            module.__dict__[name] = planted
        yield
    finally:
        for module in holders:
            module.__dict__[name] = real


class FirstSite:
    """Which call of a planted run is the defective one: the first site (module, convolution) it is asked about;
    one per planted run, so every run plants at the same site."""

    def __init__(self) -> None:
        self.site: Any = None
        self.seen = False

    def __call__(self, site: Any) -> bool:
        """Whether ``site`` is the first site seen (remembering it if none was)."""
        if not self.seen:
            self.site, self.seen = site, True
        return site is self.site


def imported_by(model: torch.nn.Module, name: str, real: Callable[..., Any]) -> bool:
    """Whether a module defining one of ``model``'s submodule classes or their attention processors (diffusers'
    processors are not modules) imported the runtime function ``real`` as ``name``."""
    classes = [type(m) for m in model.modules()] + [type(getattr(m, "processor", None)) for m in model.modules()]
    modules = {sys.modules.get(c.__module__) for c in classes}
    return any(getattr(m, "__dict__", {}).get(name) is real for m in modules if m is not None)


def _sp_implementations() -> dict[str, Callable[..., Any]]:
    """The registered SP attention implementations (Ulysses and USP wrap an inner one: ``local_attention``)."""
    return {k: v for k, v in AttentionInterface._global_mapping.items() if hasattr(v, "local_attention")}


def _implementation(inner: str | Callable[..., Any], module: torch.nn.Module) -> Callable[..., Any]:
    """The inner attention function: a registered one by name, or ``eager``: the model module's own
    ``eager_attention_forward`` (transformers registers no eager function; gpt_oss's reads its sinks there)."""
    if not isinstance(inner, str):
        return inner
    if inner in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[inner]
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return own if own is not None else AttentionInterface._global_mapping["sdpa"]


def _rank_block(mask: Any, local: int, rank: int, full: int) -> Any:
    """The rows and columns of this rank's tokens of a full-sequence mask; a ring's mask object (the ring builds
    its masks itself) becomes None: the inner implementation's own causal mask over the rank's tokens."""
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() != 4:
        return mask
    if mask.size(-1) == full:
        mask = mask.narrow(-1, rank * local, local)
    if mask.size(-2) == full:
        mask = mask.narrow(-2, rank * local, local)
    return mask


def _local_first_site(state: ParallelState) -> Callable[[torch.nn.Module], AbstractContextManager[Any]]:
    @contextmanager
    def plant(model: torch.nn.Module) -> Iterator[None]:
        originals = _sp_implementations()
        first = FirstSite()

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(module, query, key, value, attention_mask, **kwargs):
                if not first(module):
                    return original(module, query, key, value, attention_mask, **kwargs)
                mark_site(module)
                inner = original.local_attention
                attend = _implementation(inner, module)
                local = query.size(2)
                mask = _rank_block(attention_mask, local, state.sp_rank, local * state.sp_size)
                return attend(module, query, key, value, mask, **kwargs)

            return forward

        try:
            for name, original in originals.items():
                AttentionInterface.register(name, wrap(original))
            yield
        finally:
            for name, original in originals.items():
                AttentionInterface.register(name, original)

    return plant


def _first_shard_positions(model: torch.nn.Module) -> AbstractContextManager[Any]:
    """Every rank keeps the first shard's slice of the RoPE tables (``sp/rope_slice``'s
    ``slice_position_embeddings``): the positions a rank computes from its own tokens."""
    from runtime.sp import positions
    from runtime.sp.layout import rank_token_index

    correct = positions.slice_position_embeddings  # held here: the swap rebinds the name in its own module too

    def slice_position_embeddings(position_embeddings: Any, seq_dim: int = 1, form: str = "pair") -> Any:
        real = correct(position_embeddings, seq_dim, form)
        state = positions.get_parallel_state()
        if not state.sp_enabled:
            return real
        one = isinstance(position_embeddings, torch.Tensor)
        tables = (position_embeddings,) if one else tuple(position_embeddings)
        length = tables[0].shape[seq_dim]
        index = rank_token_index(length, state.sp_size, state.ring_size, 0) if state.ring_enabled else None
        if index is None:
            first = tuple(t.narrow(seq_dim, 0, length // state.sp_size) for t in tables)
        else:
            first = tuple(t.index_select(seq_dim, index.to(t.device)) for t in tables)
        return first[0] if one else first

    return swapped("slice_position_embeddings", correct, slice_position_embeddings)


def _doubled_share(state: ParallelState) -> Callable[[torch.nn.Module], AbstractContextManager[Any]]:
    @contextmanager
    def plant(model: torch.nn.Module) -> Iterator[None]:
        def post(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            if state.dp_rank == state.dp_size - 1 and getattr(output, "loss", None) is not None:
                output.loss = 2 * output.loss
            return output

        handle = model.register_forward_hook(post)
        try:
            yield
        finally:
            handle.remove()

    return plant


def planted_run(
    defect: Defect,
    model: torch.nn.Module,
    step: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    ref_loss: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
    tol: float,
    group: Any = None,
) -> Comparison:
    """``step`` run with ``defect`` planted, against the reference. First its forward alone (``step(backward=False)``
    under ``torch.no_grad``): a loss outside the tolerance on any rank of ``group`` has detected the defect, with no
    backward and no gradients gathered (most plants move the loss by far more); else the whole step, every gradient
    compared, as a defect may show in gradients only. A run-time layout check that refuses the defective run
    (``ValueError``, e.g. the DiT's replicated segment no longer equal on every rank) detected it: an error of
    infinity on every parameter (those checks agree over the group, so every rank raises alike)."""
    try:
        with defect.plant(model):
            with torch.no_grad():
                loss, _ = step(backward=False)
            seen = Comparison(defect.name, relative(loss, ref_loss), {}, tol)
            [seen] = agree([seen], group)  # every rank takes the same branch: the whole step has collectives
            if seen.failure() is not None:
                return Comparison(defect.name, seen.loss_error, dict.fromkeys(ref_grads, 0.0), tol)
            return compare(defect.name, *step(), ref_loss, ref_grads, tol)
    except ValueError:
        refused = dict.fromkeys(ref_grads, math.inf)
        return Comparison(f"{defect.name} (refused by a run-time check)", math.inf, refused, tol)


def binding_softcaps(
    model: torch.nn.Module, config: Any, row: dict[str, torch.Tensor], reads: frozenset[str]
) -> list[str]:
    """Set every softcap the job turns on and the model's code reads (``*softcap*``) to the largest logit the shrunk
    model computes on ``row``, so that it binds (``tanh(x / c) c`` moves ``x`` by a quarter at ``x = c``): random
    weights give logits far below a real model's cap of 30, where a skipped or deleted cap changes nothing.
    Returns "key job -> proof" per cap set (the start-up line); the caller rebuilds the model when any is."""
    text = config.get_text_config()
    keys = [k for k in sorted(reads) if "softcap" in k and type(getattr(text, k, None)) in (int, float)]
    if not keys:
        return []
    with torch.no_grad(), parallel_state(ParallelState()):
        logits = model(**row).logits
    largest = float(f"{logits.abs().max().item():.2g}")
    changed = []
    for key in keys:
        if largest < getattr(text, key):
            changed.append(f"{key} {getattr(text, key):g} -> {largest:g}")
            setattr(text, key, largest)
    return changed


def handled_defects(config: Any, handles: list[str]) -> list[Defect]:
    """A defect per ``[model] handles`` key ``config`` sets (not None, False or 0): the option turned off in the
    config of the model the defect is planted into (its code reads the option at each forward)."""

    def plant(key: str) -> Callable[[torch.nn.Module], AbstractContextManager[Any]]:
        @contextmanager
        def off(model: torch.nn.Module) -> Iterator[None]:
            config = model.config
            holders = [c for c in {id(c): c for c in (config, config.get_text_config())}.values() if hasattr(c, key)]
            # modules that copied the option in __init__ (``self.attn_logit_softcapping = config...``) too
            holders += [m for m in model.modules() if key in vars(m)]
            kept = [getattr(c, key) for c in holders]
            try:
                for c in holders:
                    setattr(c, key, None)
                yield
            finally:
                for c, value in zip(holders, kept, strict=True):
                    setattr(c, key, value)

        return off

    text = config.get_text_config()
    found = [key for key in handles if getattr(text, key, getattr(config, key, None)) not in (None, False, 0)]
    return [Defect(f"handled option {key} skipped", plant(key)) for key in found]


def _first_recurrence_local(correct: Callable[..., Any]) -> Callable[..., Any]:
    """``sp/linear_attention_heads``: the first module's recurrence runs on the rank's tokens (upstream's call)."""
    first = FirstSite()

    def linear_attention_heads(kernel: Callable[..., Any], module: torch.nn.Module) -> Callable[..., Any]:
        if not first(module):
            return correct(kernel, module)

        def local(*args: Any, **kwargs: Any) -> Any:
            mark_site(module)
            return kernel(*args, **kwargs)

        return local

    return linear_attention_heads


def _first_sequence_conv_local(correct: Callable[..., Any]) -> Callable[..., Any]:
    """``sp/linear_attention_conv``: the first convolution runs on the rank's tokens (upstream's call)."""
    first = FirstSite()

    def sequence_conv1d(conv: torch.nn.Conv1d, documents: Any, x: torch.Tensor) -> torch.Tensor:
        return conv(x) if first(conv) else correct(conv, documents, x)

    return sequence_conv1d


def planted_swap(
    name: str, correct: Callable[..., Any], make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[torch.nn.Module], AbstractContextManager[Any]]:
    """A plant rebinding ``name`` to a fresh defective wrapper of ``correct`` (its first-call memory is per run)."""

    def plant(model: torch.nn.Module) -> AbstractContextManager[Any]:
        return swapped(name, correct, make(correct))

    return plant


def text_defects(state: ParallelState, model: torch.nn.Module) -> list[Defect]:
    """The defect classes of a language model's layout (the module docstring); the positions class where the
    model slices RoPE tables computed from the global positions (its modules import ``slice_position_embeddings``),
    the linear-attention classes where its modules import the SP kinds of a gated delta-net."""
    found = []
    if state.sp_enabled:
        from runtime.sp import linear_attention
        from runtime.sp.positions import slice_position_embeddings

        found.append(Defect(LOCAL_ATTENTION, _local_first_site(state)))
        if imported_by(model, "slice_position_embeddings", slice_position_embeddings):
            found.append(Defect(LOCAL_POSITIONS, _first_shard_positions))
        for what, name, make in (
            (LOCAL_LINEAR_ATTENTION, "linear_attention_heads", _first_recurrence_local),
            (LOCAL_CONVOLUTION, "sequence_conv1d", _first_sequence_conv_local),
        ):
            correct = getattr(linear_attention, name)
            if imported_by(model, name, correct):
                found.append(Defect(what, planted_swap(name, correct, make), RECURRENCE if "linear" in what else ""))
    if state.dp_size > 1:
        found.append(Defect(DOUBLED_SHARE, _doubled_share(state)))
    return found
