"""Shared pieces of the dense-LM parity tests: tiny configs, a packed batch, and the SP worker."""

from __future__ import annotations

import torch
import transformers

from runtime.models.registry import causal_lm_class

VOCAB = 97


def tiny_config(model_type: str, num_kv_heads: int = 2, num_heads: int = 4) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=16,
                  max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)
    config = transformers.AutoConfig.for_model(model_type, **common)
    config._attn_implementation = "sdpa"
    return config


def models(model_type: str, seed: int = 0, **config_kwargs):
    """(upstream, generated) with identical weights, fp32, eval-free (dropout is 0 in these configs)."""
    config = tiny_config(model_type, **config_kwargs)
    torch.manual_seed(seed)
    upstream = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    generated = causal_lm_class(model_type)(config)
    generated.load_state_dict(upstream.state_dict())
    return upstream, generated


def packed_batch(lengths: tuple[int, ...], seed: int = 1) -> dict[str, torch.Tensor]:
    """One row holding several sequences: position ids restart per sequence, no label crosses a boundary."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    input_ids = torch.randint(1, VOCAB, (1, total), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[position_ids == 0] = -100  # a sequence's first token is nobody's target
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pad_for_sp(batch: dict[str, torch.Tensor], sp: int) -> dict[str, torch.Tensor]:
    """Append a padding segment so the row divides by sp: its own position ids, no labels."""
    total = batch["input_ids"].shape[1]
    pad = -total % sp
    if pad == 0:
        return batch
    return {
        "input_ids": torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1),
        "position_ids": torch.cat([batch["position_ids"], torch.arange(pad)[None]], 1),
        "labels": torch.cat([batch["labels"], torch.full((1, pad), -100)], 1),
    }


def sp_worker(rank: int, world_size: int, cases: list[tuple[str, tuple[int, ...], dict]]) -> list[dict]:
    """Run every case with sp=world_size; return the loss, gathered logits and SP-summed gradients."""
    import torch.distributed as dist

    from runtime.parallel.collectives import gather_along_dim, slice_for_rank
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size)
    group = state.sp_group
    results = []
    for model_type, lengths, config_kwargs in cases:
        _, model = models(model_type, **config_kwargs)
        batch = pad_for_sp(packed_batch(lengths), world_size)
        local = {k: slice_for_rank(v, 1, group) for k, v in batch.items() if k != "position_ids"}
        out = model(**local, position_ids=batch["position_ids"])
        out.loss.backward()
        partial = grads(model)
        for g in partial.values():  # partial-gradient convention: the true gradient is the sum over SP ranks
            dist.all_reduce(g, group=group)
        logits = gather_along_dim(out.logits.detach(), 1, group)[:, : sum(lengths)]
        results.append({"loss": out.loss.detach(), "logits": logits, "grads": partial})
    return results
