"""Step metrics: loss, grad norm, lr, tokens/s, model TFLOP/s and MFU, steps skipped as non-finite, to console, JSONL
and tensorboard."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

# Dense bf16 peak TFLOP/s per device, for MFU when the config does not give one.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def detect_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding matmul params) + attention scores (causal, fwd+bwd).

    The matmul term counts q/k/v/o, the gated MLP (for MoE: the top-k experts and the router) and the LM head;
    the attention term is
    6 * layers * seq_len * heads * head_dim (half of the full 12x because of the causal mask).
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k:  # MoE: each token runs top_k experts plus the router
        mlp = 3 * hidden * config.moe_intermediate_size * top_k + hidden * config.num_experts
    else:
        mlp = 3 * hidden * config.intermediate_size
    params = layers * (attn + mlp) + hidden * config.vocab_size
    return 6.0 * params + 6.0 * layers * seq_len * heads * head_dim


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # valid target tokens in the global batch
    tokens_per_s: float  # all tokens processed per second, whole job
    tflops_per_device: float
    mfu: float | None
    skipped_nonfinite: int = 0  # steps of the run so far whose update was skipped (train.nonfinite: skip)
    eval_loss: float | None = None  # the eval set's loss after this step (runtime/train/evaluate.py), if measured


class MetricsLogger:
    """Rank-0 sink; other ranks construct it with enabled=False and every call is a no-op."""

    def __init__(
        self,
        log_dir: Path,
        total_steps: int,
        enabled: bool,
        tensorboard: bool,
        progress: bool,
        stream: TextIO | None = None,
    ) -> None:
        stream = stream if stream is not None else sys.stdout  # the current stdout, not the one at import time
        self.enabled, self.total_steps, self.stream = enabled, total_steps, stream
        self._jsonl = self._writer = self._bar = None
        if not enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (log_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("tensorboard not installed; logging to metrics.jsonl only", file=stream)
            else:
                self._writer = SummaryWriter(str(log_dir / "tb"))
        if progress and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, dynamic_ncols=True, file=stream)

    def log(self, m: StepMetrics, echo: bool = True) -> None:
        """Record every step to JSONL/tensorboard; print it (and move the bar) when `echo`."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(asdict(m)) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in asdict(m).items():
                if key != "step" and value is not None:
                    self._writer.add_scalar(key, value, m.step)
        if not echo:
            return
        mfu = f" mfu {m.mfu:.1%}" if m.mfu is not None else ""
        skipped = f" skipped_nonfinite {m.skipped_nonfinite}" if m.skipped_nonfinite else ""
        line = (
            f"step {m.step:>5}/{self.total_steps} loss {m.loss:.4f} grad_norm {m.grad_norm:.3f} lr {m.lr:.2e} "
            f"tok/s {m.tokens_per_s:,.0f} tflops/dev {m.tflops_per_device:.3f}{mfu}{skipped}"
        )
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {m.loss:.4f}")
            self._bar.update(m.step - self._bar.n)
            self._bar.write(line)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        for sink in (self._jsonl, self._writer, self._bar):
            if sink is not None:
                sink.close()
