"""The GRPO trainer on 2 gloo ranks (FSDP2) takes the same step as one process that holds both ranks' groups.

Each rank rolls out its own samples (its generators are seeded with its rank), so the single-process reference
takes both ranks' prompts and generators in one batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def grpo_worker(rank: int, world: int, ranks_in_one: int = 1) -> dict:
    from runtime.flowgrpo.rewards import LatentMeanReward
    from runtime.flowgrpo.trainer import FlowGRPOTrainer, GRPOConfig
    from tests.flowgrpo.test_trainer import PROMPTS, _setup

    class RanksInOneTrainer(FlowGRPOTrainer):
        def generators(self, batch_size: int) -> list[torch.Generator]:
            per_rank = batch_size // ranks_in_one
            base = (self.config.seed * 1_000_003 + self.iteration) * 100_003  # the trainer's seeding rule
            return [
                torch.Generator().manual_seed(base + r * 10_007 + i)
                for r in range(ranks_in_one)
                for i in range(per_rank)
            ]

    if world > 1:
        from runtime.parallel.state import init_parallel_state

        init_parallel_state()
    adapter, module, batch = _setup(seed=0)
    batch = {k: torch.cat([v] * ranks_in_one) for k, v in batch.items()}
    cls = RanksInOneTrainer if ranks_in_one > 1 else FlowGRPOTrainer
    trainer = cls(adapter, module, LatentMeanReward(0.5), GRPOConfig(group_size=3, lr=1e-2), latent_shape=(4, 8, 8))
    metrics = trainer.train_step(PROMPTS * ranks_in_one, batch)
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in trainer.module.named_parameters()
    }
    return {"metrics": metrics, "params": params}


@pytest.mark.dist
def test_fsdp_step_equals_single_process() -> None:
    single = grpo_worker(0, 1, ranks_in_one=2)
    ranks = run_distributed(grpo_worker, 2, timeout=300)
    for got in ranks:
        ref = single["metrics"]["grad_norm"]
        assert abs(got["metrics"]["grad_norm"] - ref) <= 1e-5 * ref, (got["metrics"], single["metrics"])
        for name, value in single["params"].items():
            key = name if name in got["params"] else next(k for k in got["params"] if k.endswith(name))
            torch.testing.assert_close(got["params"][key], value, rtol=1e-5, atol=1e-6)
