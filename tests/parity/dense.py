"""Shared pieces of the dense-LM parity tests: paired models with equal weights and the SP worker."""

from __future__ import annotations

import torch
import transformers

from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import random_packed_batch, tiny_config

VOCAB = tiny_config("qwen3").vocab_size


def models(model_type: str, seed: int = 0, **config_overrides):
    """(upstream, generated) with identical weights, fp32, the attention the tiny config names (sdpa unless the
    spec says otherwise)."""
    config = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    upstream = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    generated = causal_lm_class(model_type)(config)
    generated.load_state_dict(upstream.state_dict())
    return upstream, generated


def packed_batch(lengths: tuple[int, ...], seed: int = 1) -> dict[str, torch.Tensor]:
    return random_packed_batch(lengths, VOCAB, seed)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (whole: a sharded one gathered), one the backward did not reach as
    zeros (the same on every rank and side); a frozen parameter (``requires_grad`` False: no gradient by design) is
    left out, so the suites compare what exists. Collective for sharded parameters: every rank calls it."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        out[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def sp_worker(
    rank: int,
    world_size: int,
    cases: list[tuple[str, tuple[int, ...], dict, dict]],
    ring: int = 1,
    checkpointing: bool = False,
) -> list[dict]:
    """Run every case with sp=world_size (Ulysses ``world_size / ring`` x ring ``ring``, gradient checkpointing
    optional); return the loss, gathered logits and SP-summed gradients."""
    import torch.distributed as dist

    from runtime.data.sp_batch import shard_for_sp
    from runtime.parallel.collectives import gather_along_dim
    from runtime.parallel.state import init_parallel_state
    from runtime.sp.layout import to_natural_order

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    results = []
    for model_type, lengths, config_overrides, forward_kwargs in cases:
        _, model = models(model_type, **config_overrides)
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.train()
        out = model(**shard_for_sp(packed_batch(lengths), state), **forward_kwargs)
        out.loss.backward()
        partial = grads(model)
        for g in partial.values():  # partial-gradient convention: the true gradient is the sum over SP ranks
            dist.all_reduce(g, group=state.sp_group)
        logits = None if out.logits is None else gather_along_dim(out.logits.detach(), 1, state.sp_group)
        logits = None if logits is None else to_natural_order(logits, 1, world_size, ring)  # zigzag under a ring
        logits = None if logits is None else logits[:, : sum(lengths)]
        results.append({"loss": out.loss.detach(), "logits": logits, "grads": partial})
    return results


def gathered_like_one_process(got: dict, state, tokens: int) -> dict:
    """A rank's SP result in one process's terms: every gradient summed over the SP group (each rank's holds its
    tokens' share) and the logits gathered over it in natural token order, cut to the row's ``tokens``."""
    import torch.distributed as dist

    from runtime.parallel.collectives import gather_along_dim
    from runtime.sp.layout import to_natural_order

    for g in got["grads"].values():
        dist.all_reduce(g, group=state.sp_group)
    logits = gather_along_dim(got["logits"], 1, state.sp_group)
    logits = to_natural_order(logits, 1, state.sp_size, state.ring_size)
    return {**got, "logits": logits[:, :tokens]}
