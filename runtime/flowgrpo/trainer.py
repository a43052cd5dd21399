"""The Flow-GRPO training loop (one ``train_step`` = one iteration: rollout, reward, advantages, update).

Per iteration, for ``P`` prompts and group size ``G`` (``B = P * G`` samples):

1. Rollout (no grad, current policy): ``runtime.flowgrpo.rollout.rollout`` with one ``torch.Generator`` per sample,
   seeded from ``(config.seed, iteration, sample)``; each sample has a window of ``W`` stochastic steps.
2. Rewards on the final latents (or on ``decode(final latents)`` when a decode function is given), then
   ``group_advantages`` within each prompt's group.
3. For each inner epoch, each window step ``j`` and each micro-batch of samples: recompute ``log p`` of the rollout's
   step ``latents[:, j] -> latents[:, j + 1]`` with grad through the adapter's same ``step()`` (so rollout and
   training cannot differ in how they build inputs or take the step), the clipped ``policy_loss`` against the
   rollout log-prob, plus ``kl_coef * kl_to_reference`` where the reference is the same module with its LoRA
   adapters disabled (``disabled_adapters`` context, no grad) or an explicit ``reference_module``. Losses are scaled
   by ``micro_batch / B / W`` and accumulated, so one AdamW step per inner epoch follows the gradient of the mean
   loss over all samples and window steps.

With one inner epoch the policy has not moved since the rollout when the gradient is taken: the ratio is 1 (exactly
1 when the micro-batch layout equals the rollout's: all samples in one micro-batch at the same step indices).

Non-finite values: before each AdamW step the learning rate, the epoch's loss and the gradient norm must be finite
(``runtime/train/finite.py``, agreed over the ranks): otherwise the iteration stops with ``NonFiniteError`` naming
the prompts (``nonfinite="stop"``) or the update is skipped and counted in ``skipped_nonfinite`` (``"skip"``).

Distributed: when ``torch.distributed`` is initialised with world size > 1 the module is sharded with FSDP2 via
``runtime.parallel.fsdp.apply_fsdp`` (before the optimizer is built). Each rank rolls out WHOLE groups (its own
prompts), so the group advantages need no communication; ``apply_fsdp`` SUMS gradients over ranks, so each rank's
loss is divided by the world size (the update is the gradient of the mean over ranks).
tests/flowgrpo/test_trainer_fsdp.py checks a 2-rank step against one process holding both ranks' groups.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.flowgrpo.algorithm import AdvantageMode, KlForm, group_advantages, kl_to_reference, policy_loss
from runtime.flowgrpo.rewards import check_rewards
from runtime.flowgrpo.rollout import RolloutResult, rollout
from runtime.train.finite import check_mode, guard_update, micro_batches

__all__ = ["GRPOConfig", "FlowGRPOTrainer", "disabled_adapters", "repeat_batch", "select_rows"]


@dataclass
class GRPOConfig:
    num_inference_steps: int = 6
    window_size: int = 2
    window_start_range: tuple[int, int] | None = None  # inclusive; None: (0, N - W)
    noise_level: float | None = None  # None: the adapter's
    group_size: int = 4
    micro_batch_size: int | None = None  # None: all B samples in one micro-batch
    num_inner_epochs: int = 1
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    advantage_mode: AdvantageMode = "group"
    advantage_ddof: int = 1  # 1: verl-omni's sample std, 0: flow_grpo's population std
    kl_coef: float = 0.0
    kl_form: KlForm = "scaled"  # "scaled": verl-omni's / flow_grpo's (exact KL x -dt for "sde"), "exact"
    max_grad_norm: float | None = 1.0
    seed: int = 0
    nonfinite: str = "stop"  # a non-finite loss or gradient norm: "stop" (NonFiniteError) or "skip" the update


@contextlib.contextmanager
def disabled_adapters(module: nn.Module) -> Iterator[nn.Module]:
    """Run ``module`` as its base model (LoRA adapters disabled) inside the block; re-enables them after."""
    if not hasattr(module, "disable_adapters"):
        raise ValueError(f"{type(module).__name__} has no adapters to disable; pass reference_module instead")
    module.disable_adapters()
    try:
        yield module
    finally:
        module.enable_adapters()


def repeat_batch(batch: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Each prompt's conditioning repeated ``repeats`` times in place (``[p0, p0, ..., p1, p1, ...]``)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.repeat_interleave(repeats, dim=0)
        elif isinstance(v, list | tuple):
            out[k] = [x for x in v for _ in range(repeats)]
        else:
            out[k] = v
    return out


def select_rows(batch: dict[str, Any], rows: torch.Tensor | Sequence[int]) -> dict[str, Any]:
    """The rows ``rows`` of every per-sample entry (tensors and lists); other entries (the schedule) are shared."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[idx.to(v.device)]
        elif isinstance(v, list | tuple):
            out[k] = [v[i] for i in idx.tolist()]
        else:
            out[k] = v
    return out


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class FlowGRPOTrainer:
    """GRPO on one adapter + module. ``reward(samples, prompts) -> [B]`` (see ``runtime.flowgrpo.rewards``).

    ``latent_shape`` is one sample's latent shape (e.g. ``(C, H, W)``). Trains the parameters that require grad
    (after ``add_adapter`` only the LoRA ones; on a plain module all of them) unless ``params`` is given.
    """

    def __init__(
        self,
        adapter: Any,
        module: nn.Module,
        reward: Callable[[torch.Tensor, Sequence[Any]], torch.Tensor],
        config: GRPOConfig | None = None,
        *,
        latent_shape: Sequence[int],
        decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
        reference_module: nn.Module | None = None,
        params: Sequence[nn.Parameter] | None = None,
        rollout_fn: Callable[..., RolloutResult] = rollout,
    ):
        self.adapter = adapter
        self.config = config or GRPOConfig()
        self.reward = reward
        self.latent_shape = tuple(latent_shape)
        self.decode = decode
        self.reference_module = reference_module
        self.rollout_fn = rollout_fn
        self.world_size = _world_size()
        if self.world_size > 1:
            from runtime.parallel.fsdp import apply_fsdp

            module = apply_fsdp(module)
        self.module = module
        self.params = [p for p in (params if params is not None else module.parameters()) if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters (nothing requires grad)")
        c = self.config
        check_mode(c.nonfinite, "GRPOConfig.nonfinite")
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)
        self.iteration = 0
        self.skipped_nonfinite = 0  # updates skipped so far (nonfinite="skip")
        self.history: list[dict[str, float]] = []

    @property
    def noise_level(self) -> float:
        return float(self.adapter.noise_level if self.config.noise_level is None else self.config.noise_level)

    def generators(self, batch_size: int) -> list[torch.Generator]:
        base = (self.config.seed * 1_000_003 + self.iteration) * 100_003
        rank = dist.get_rank() if self.world_size > 1 else 0
        return [torch.Generator().manual_seed(base + rank * 10_007 + i) for i in range(batch_size)]

    def _reference_means(self, batch, latents, step_index, prev_sample, levels) -> torch.Tensor:
        with torch.no_grad():
            if self.reference_module is not None:
                ctx, ref = contextlib.nullcontext(), self.reference_module
            else:
                ctx, ref = disabled_adapters(self.module), self.module
            with ctx:
                _, mean, _, _ = self.adapter.forward_and_sample_previous_step(
                    ref, batch, latents, step_index, prev_sample=prev_sample, noise_level=levels
                )
        return mean

    def train_step(self, prompts: Sequence[Any], batch: dict[str, Any]) -> dict[str, float]:
        """One iteration on ``prompts`` (``P`` of them) with per-prompt conditioning ``batch`` (leading dim ``P``)."""
        c = self.config
        g = c.group_size
        full = repeat_batch(batch, g)
        sample_prompts = [p for p in prompts for _ in range(g)]
        b = len(sample_prompts)
        group_ids = torch.arange(len(prompts)).repeat_interleave(g)

        self.module.eval()
        res = self.rollout_fn(
            self.adapter,
            self.module,
            full,
            latent_shape=self.latent_shape,
            num_inference_steps=c.num_inference_steps,
            window_size=c.window_size,
            generators=self.generators(b),
            window_start_range=c.window_start_range,
            noise_level=self.noise_level,
        )
        with torch.no_grad():
            samples = res.final_latents if self.decode is None else self.decode(res.final_latents)
            rewards = check_rewards(self.reward(samples, sample_prompts), b)
        advantages = group_advantages(rewards, group_ids, mode=c.advantage_mode, ddof=c.advantage_ddof)

        device = res.final_latents.device
        train_batch = {**full, "schedule": res.schedule.to(device)}
        mb = c.micro_batch_size or b
        w = res.step_indices.shape[1]
        stats: dict[str, list[float]] = {k: [] for k in ("loss", "clip_fraction", "approx_kl", "ratio_mean", "kl")}
        grad_norms = []
        self.module.train()
        for epoch in range(c.num_inner_epochs):
            order = torch.arange(b)
            if epoch > 0:  # later epochs shuffle the samples (seeded)
                order = torch.randperm(b, generator=torch.Generator().manual_seed(c.seed + 7919 * self.iteration))
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            micro_losses: list[torch.Tensor] = []
            micro_prompts: list[list[str]] = []
            for j in range(w):
                for start in range(0, b, mb):
                    rows = order[start : start + mb]
                    n = len(rows)
                    sub = select_rows(train_batch, rows)
                    x = res.latents[rows, j].to(device)
                    prev = res.latents[rows, j + 1].to(device)
                    step_index = res.step_indices[rows, j].to(device)
                    levels = torch.full((n,), self.noise_level, device=device)
                    log_prob, mean, std_dev_t, sqrt_dt = self.adapter.forward_and_sample_previous_step(
                        self.module, sub, x, step_index, prev_sample=prev, noise_level=levels
                    )
                    old = res.log_probs[rows, j].to(log_prob.device)
                    loss, clip_frac, approx_kl = policy_loss(
                        log_prob, old, advantages[rows].to(log_prob.device), c.clip_range, c.adv_clip_max
                    )
                    kl = torch.zeros((), device=log_prob.device)
                    if c.kl_coef > 0:
                        ref_mean = self._reference_means(sub, x, step_index, prev, levels)
                        kl = kl_to_reference(mean, ref_mean, std_dev_t, sqrt_dt, c.kl_form)
                        loss = loss + c.kl_coef * kl
                    scaled = loss * (n / b / w / self.world_size)
                    scaled.backward()
                    total += scaled.item()
                    micro_losses.append(scaled.detach())
                    micro_prompts.append([f"prompt {sample_prompts[r]!r}"[:120] for r in rows.tolist()])
                    stats["clip_fraction"].append(clip_frac.item())
                    stats["approx_kl"].append(approx_kl.item())
                    stats["ratio_mean"].append(torch.exp(log_prob.detach() - old).mean().item())
                    stats["kl"].append(kl.item())
            stats["loss"].append(total)
            if self.world_size > 1:  # DTensor gradients: the norm over the full (sharded) gradients
                from runtime.parallel.fsdp import clip_grad_norm_
            else:
                clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
            norm = clip_grad_norm_(self.params, c.max_grad_norm or math.inf)
            grad_norms.append(float(norm))
            applied = guard_update(
                f"iteration {self.iteration} (inner epoch {epoch})",
                torch.tensor(total),
                norm,
                self.optimizer,
                mode=c.nonfinite,
                sources=functools.partial(micro_batches, micro_losses, micro_prompts),
                lr_setting="GRPOConfig.lr",
                mode_setting="GRPOConfig.nonfinite",
            )
            if applied:
                self.optimizer.step()
            else:
                self.skipped_nonfinite += 1
        self.module.eval()

        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics.update(
            iteration=self.iteration,
            reward_mean=rewards.mean().item(),
            reward_std=rewards.std(unbiased=False).item(),
            grad_norm=sum(grad_norms) / len(grad_norms),
            skipped_nonfinite=self.skipped_nonfinite,
        )
        self.last_rollout, self.last_rewards = res, rewards
        self.history.append(metrics)
        self.iteration += 1
        return metrics

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)
