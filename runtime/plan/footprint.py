"""What one micro-batch of a real-size model costs, measured on fake tensors (shapes and dtypes only, no memory).

The generated model is built inside ``FakeTensorMode`` in the compute dtype (bf16 by default: FSDP2's
``param_dtype``), then runs one forward of the workload while ``saved_tensors_hooks`` record every tensor autograd
saves for backward, by storage (a storage saved twice counts once), attributed to the transformer block
(``_no_split_modules``) that saved it first, or to the model outside the blocks. Three stand-ins keep the forward free
of data-dependent shapes and of what only a GPU runs:

* attention: every ``scaled_dot_product_attention`` call becomes a flash-attention-like function that saves what
  flash-attention saves (q, k, v, the output and an fp32 log-sum-exp per query and head), never an L x L matrix;
* MoE experts: ``experts_implementation="patchgen_plan"`` runs the grouped experts (``experts_from_sorted``, the
  training path) on a balanced routing (every expert T*k/E rows), the expected load of a trained router.
* host reads: a module whose forward reads tensor values to the host (Lumina2's ``rope_embedder``) runs on real
  tensors and hands back fake ones (``host_reads``; which modules: ``dit_inputs.HOST_READS``).

The counts are exact for the code that runs: the same modules, the same saved tensors as the training forward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from runtime import torch_compat
from runtime.plan.config import PlanConfig
from runtime.torch_compat import TorchDispatchMode

__all__ = ["Footprint", "measure"]

PLAN = "patchgen_plan"  # the attention and experts implementations of a plan (below)


@dataclass(frozen=True)
class Footprint:
    """Parameter counts and the bytes saved for backward of one micro-batch in one process (no parallelism)."""

    name: str
    params: int
    root_params: int  # outside every block: embeddings, heads, final norms (FSDP2's root group)
    block_params: tuple[int, ...]  # each block's parameters other than routed experts
    block_expert_params: tuple[int, ...]  # each block's routed-expert parameters (sharded by EP)
    saved_outside: int  # bytes saved for backward outside the blocks (embeddings, loss, patchify, ...)
    saved_blocks: tuple[int, ...]  # bytes each block saves for backward
    block_inputs: tuple[int, ...]  # bytes of each block's input hidden states (what checkpointing keeps)
    peak: int  # peak bytes of live tensors during forward+backward, parameters and their gradients left out
    peak_checkpointed: int  # the same with every block checkpointed (recomputed in backward)
    tokens: int  # tokens of the micro-batch (DiTs: latent tokens after patchify)
    heads: int  # attention heads (SP must divide them)
    experts: int  # routed experts per MoE layer (0: dense)
    dtype_bytes: int

    @property
    def expert_params(self) -> int:
        return sum(self.block_expert_params)


class _LivePeak(TorchDispatchMode):
    """Peak bytes of the tensors that ops create and that are still alive (a storage counts once, until its last
    tensor dies), minus ``offset()``; runs above the fake mode, so it sees every op of the forward and backward."""

    def __init__(self, offset: Any) -> None:
        super().__init__()
        self.offset = offset
        self.live = self.peak = 0
        self.refs: dict[int, list[int]] = {}

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch_compat.tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.refs:
                    self.refs[key] = [0, storage.nbytes()]
                    self.live += storage.nbytes()
                self.refs[key][0] += 1
                weakref.finalize(t, self._release, key)
        self.peak = max(self.peak, self.live - self.offset())
        return out


class _FlashSaved(torch.autograd.Function):
    """Saves what flash-attention's forward saves: q, k, v, out and an fp32 log-sum-exp (B, H, L); the output is laid
    out as flash (and torch's CPU flash) lays it out, so a following ``transpose(1, 2).flatten`` is a view."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        batch, heads, length, _ = q.shape  # the output in flash-attention's memory layout: (B, L, H, D) transposed
        out = q.new_empty(batch, length, heads, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FlashLikeAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            kwargs = kwargs or {}
            qkv = [*args[:3], *(kwargs[name] for name in ("query", "key", "value")[len(args[:3]) :])]
            return _FlashSaved.apply(*qkv)
        return func(*args, **(kwargs or {}))


class _GroupedLinearSaved(torch.autograd.Function):
    """``grouped_linear``'s memory on fake tensors in one op each way: it saves what ``_GroupedLinear`` saves
    (``x``, ``weight``, the counts) and its backward allocates the input and weight gradients it allocates."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight, counts)
        return x.new_empty(x.size(0), weight.size(1))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


def _plan_experts(module: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The grouped training experts (``experts_from_sorted``) on a balanced routing: no data-dependent shape.
    Experts of a layout the fused kernels do not compute (gpt_oss: biases, interleaved gate/up, a clamped gate)
    run what the trainer runs for them, ``patchgen_eager`` (transformers' grouped_mm over the module's layout)."""
    from runtime.moe.dispatch import expert_layout_problem
    from runtime.moe.experts import experts_from_sorted

    if expert_layout_problem(module) is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(module, hidden, top_k_index, top_k_weights)

    experts, top_k = module.gate_up_proj.size(0), top_k_index.size(1)
    rows = hidden.size(0) * top_k
    order = torch.arange(rows, device=hidden.device)
    token_idx = torch.div(order, top_k, rounding_mode="floor")
    counts = torch.full((experts,), rows // experts, device=hidden.device)
    return experts_from_sorted(
        hidden,
        order,
        token_idx,
        counts,
        top_k_weights,
        module.gate_up_proj,
        module.down_proj,
        module.act_fn,
        _GroupedLinearSaved.apply,
    )


def _plan_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any):
    """transformers' attention interface: flash-attention's saved tensors (GQA without repeating K/V), no mask."""
    return _FlashSaved.apply(query, key, value).transpose(1, 2).contiguous(), None


def _register_plan_kernels() -> None:
    """``patchgen_plan`` attention (no L x L mask is built, as for flash-attention) and experts, in transformers'
    interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PLAN, _plan_attention)
    AttentionMaskInterface.register(PLAN, lambda *args, **kwargs: None)
    _register_plan_experts()


def _register_plan_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if PLAN not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(PLAN, _plan_experts)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _is_dit(model_type: str) -> bool:
    from runtime.models.registry import lookup

    return lookup(model_type).family == "dit"


def build_model(plan: PlanConfig) -> nn.Module:
    """The generated model of ``plan`` (called inside the fake mode and the compute dtype)."""
    model_type, config = plan.model.type, dict(plan.model.config)
    if _is_dit(model_type):
        from runtime.diffusion.registry import training_class

        cls = training_class(model_type)
        return cls(cls.config_class(**config))
    import transformers

    from runtime.models.registry import lookup

    entry = lookup(model_type)
    hf_config = transformers.AutoConfig.for_model(model_type, **{**config, "use_cache": False})
    hf_config.get_text_config().use_cache = False  # as the trainer: a sub-config's cache would grow in a recompute
    _register_plan_kernels()
    hf_config._attn_implementation = PLAN
    if entry.is_moe:
        hf_config._experts_implementation = PLAN
    return entry.model_class()(hf_config)


def _text_inputs(plan: PlanConfig, model: nn.Module) -> dict[str, Any]:
    tokens = plan.workload.tokens
    if tokens is None:
        raise ValueError(f"{plan.model.type}: workload.tokens is required for a text model")
    ids = torch.zeros(1, tokens, dtype=torch.long)
    inputs: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if plan.workload.loss_chunk_size is not None:
        inputs["loss_chunk_size"] = plan.workload.loss_chunk_size
    rope = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
    if "mrope_section" in rope:  # multimodal RoPE: text-only position ids on every channel (4: text row + T/H/W)
        inputs["position_ids"] = torch.arange(tokens).expand(4, 1, tokens)
    return inputs


def _dit_inputs(plan: PlanConfig, model: nn.Module) -> tuple[dict[str, Any], int]:
    """Latents and conditions of one clip/image at the workload's pixel size; (inputs, latent tokens)."""
    from runtime.plan.dit_inputs import HOST_READS, dit_inputs
    from runtime.plan.host_reads import run_on_host

    run_on_host(model, HOST_READS.get(plan.model.type, ()))
    return dit_inputs(plan.model, model.config, plan.workload)


def _blocks(model: nn.Module) -> list[nn.Module]:
    from runtime.parallel.fsdp import block_modules

    return block_modules(model)


def _numel(params: Iterator[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _expert_params(block: nn.Module) -> int:
    """Routed experts' stacked parameters (EP shards them): modules with ``gate_up_proj`` and ``down_proj``."""
    total = 0
    for module in block.modules():
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and hasattr(module, "down_proj"):
            total += module.gate_up_proj.numel() + module.down_proj.numel()
    return total


def _heads(model: nn.Module) -> int:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_attention_heads", 0) or getattr(config, "num_attention_heads", 0))


def _loss(out: Any) -> Tensor:
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out[0].float().square().mean()


def _step(model: nn.Module, inputs: dict[str, Any], fake: Any, dtype: torch.dtype, pack: Any = None) -> int:
    """One forward+backward on fake tensors; the peak bytes of live tensors other than parameter gradients."""
    grads = [0]
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(0, grads[0] + p.grad.nbytes))
        for p in model.parameters()
        if p.requires_grad
    ]
    saving = torch.autograd.graph.saved_tensors_hooks(pack, _keep) if pack else contextlib.nullcontext()
    tracker = _LivePeak(lambda: grads[0])
    try:
        with fake, _default_dtype(dtype), _FlashLikeAttention(), tracker:
            with saving:
                loss = _loss(model(**inputs))
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return tracker.peak


def measure(plan: PlanConfig, dtype: torch.dtype = torch.bfloat16, progress: Callable[[str], Any] = str) -> Footprint:
    """The footprint of one micro-batch of ``plan`` in one process, in compute dtype ``dtype``; ``progress`` hears
    each stage as it starts (a real size's fake step takes tens of seconds on a small CPU; default: nothing said)."""
    fake = torch_compat.fake_tensor_mode()
    progress("building the model on fake tensors")
    with fake, _default_dtype(dtype):
        model = build_model(plan)
        model.train()
        if _is_dit(plan.model.type):
            inputs, tokens = _dit_inputs(plan, model)
        else:
            inputs, tokens = _text_inputs(plan, model), plan.workload.tokens
    blocks = _blocks(model)
    index = {id(b): i for i, b in enumerate(blocks)}
    current: list[int | None] = [None]
    saved: dict[int, tuple[int | None, int]] = {}
    inputs_bytes = [0] * len(blocks)

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        current[0] = index[id(module)]
        hidden = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("hidden_states")
        if isinstance(hidden, Tensor):
            inputs_bytes[current[0]] = hidden.numel() * hidden.element_size()

    def post(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        current[0] = None

    def pack(t: Tensor) -> Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            saved.setdefault(storage._cdata, (current[0], storage.nbytes()))
        return t

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(post, with_kwargs=True) for b in blocks]
    progress(f"forward+backward of {tokens} tokens, activation checkpointing off")
    try:
        peak = _step(model, inputs, fake, dtype, pack)
    finally:
        for handle in handles:
            handle.remove()
    for block in blocks:  # what apply_activation_checkpointing does, with the attention stand-in in the recompute
        block.forward = functools.partial(_checkpointed, block.forward)
    progress(f"forward+backward of {tokens} tokens, activation checkpointing on")
    peak_checkpointed = _step(model, inputs, fake, dtype)
    per_block = [0] * len(blocks)
    outside = 0
    for owner, nbytes in saved.values():
        if owner is None:
            outside += nbytes
        else:
            per_block[owner] += nbytes
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    experts = max((_expert_count(b) for b in blocks), default=0)
    return Footprint(
        name=plan.model.name or plan.model.type,
        params=_numel(model.parameters()),
        root_params=_numel(p for p in model.parameters() if id(p) not in in_blocks),
        block_params=tuple(_numel(b.parameters()) - _expert_params(b) for b in blocks),
        block_expert_params=tuple(_expert_params(b) for b in blocks),
        saved_outside=outside,
        saved_blocks=tuple(per_block),
        block_inputs=tuple(inputs_bytes),
        peak=peak,
        peak_checkpointed=peak_checkpointed,
        tokens=int(tokens),
        heads=_heads(model),
        experts=experts,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
    )


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """A block under non-reentrant activation checkpointing (the trainer's), recomputing with the same stand-ins."""
    return torch.utils.checkpoint.checkpoint(
        forward,
        *args,
        use_reentrant=False,
        context_fn=lambda: (_FlashLikeAttention(), _FlashLikeAttention()),
        **kwargs,
    )


def _keep(t: Tensor) -> Tensor:
    return t


def _expert_count(block: nn.Module) -> int:
    for module in block.modules():
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and hasattr(module, "down_proj"):
            return int(module.gate_up_proj.shape[0])
    return 0
