"""SP=2 vs single process for a tiny generated qwen3.

Run: `torchrun --nproc-per-node 2 -m runtime.demos.sp_parity`.

Prints, on rank 0, the loss of both runs and the largest relative gradient difference.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from runtime.data.sp_batch import shard_for_sp
from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import random_packed_batch, tiny_config
from runtime.parallel.collectives import gather_along_dim
from runtime.parallel.state import ParallelState, init_parallel_state, parallel_state
from runtime.parallel.teardown import torn_down


def forward_backward(model_type: str, batch: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, torch.Tensor, ...]:
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = causal_lm_class(model_type)(config)
    out = model(**batch)
    out.loss.backward()
    return model, out.loss.detach(), out.logits.detach()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(model_type: str = "qwen3", lengths: tuple[int, ...] = (29, 42, 17)) -> None:
    torch.set_num_threads(1)
    state = init_parallel_state(sp_size=int(os.environ.get("WORLD_SIZE", "1")))
    batch = random_packed_batch(lengths, tiny_config(model_type).vocab_size)
    with parallel_state(ParallelState()):  # the single-process reference, SP off
        reference, ref_loss, ref_logits = forward_backward(model_type, batch)
    model, loss, logits = forward_backward(model_type, shard_for_sp(batch, state))
    logits = gather_along_dim(logits, 1, state.sp_group)[:, : sum(lengths)]
    worst, worst_name = 0.0, ""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if state.sp_group is not None:
            dist.all_reduce(grad, group=state.sp_group)  # partial gradients sum to the true one
        err = relative(grad, ref_params[name].grad)
        if err > worst:
            worst, worst_name = err, name
    if state.rank == 0:
        print(f"tiny {model_type}, packed row of {len(lengths)} sequences {lengths}, sp={state.sp_size}, fp32")
        print(f"{'run':<18} {'loss':>12}")
        print(f"{'single process':<18} {ref_loss.item():12.8f}")
        print(f"{'sp=' + str(state.sp_size):<18} {loss.item():12.8f}")
        print(f"relative loss difference:          {relative(loss, ref_loss):.2e}")
        print(f"relative logits difference:        {relative(logits, ref_logits):.2e}")
        print(f"max relative gradient difference:  {worst:.2e} ({worst_name})")
        print("PASS" if max(worst, relative(loss, ref_loss)) < 1e-5 else "FAIL (tolerance 1e-5)")


if __name__ == "__main__":
    with torn_down():  # barrier, destroy and free the groups (their threads) before the interpreter exits
        main()
