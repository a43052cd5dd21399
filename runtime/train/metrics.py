"""Step metrics: loss, grad norm, lr, tokens/s, model TFLOP/s and MFU, steps skipped as non-finite, to the console,
``metrics.jsonl`` and the trackers of ``log.report_to`` (``runtime/train/tracking``), and the loss curve at the end."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from runtime.train.tracking.plots import Panel
from runtime.train.tracking.run_log import RunLog

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


# The end-of-run plot (``<log.dir>/loss.png``): the training loss (and an eval loss when one is logged), the lr.
LOSS_PANELS = (
    Panel("loss", ("loss", "eval_loss"), log_y=True),
    Panel("learning rate", ("lr",)),
)


class MetricsLogger:
    """Rank-0 sink of the trainer: every step to ``<log.dir>/metrics.jsonl`` and the trackers of ``log.report_to``,
    a console line every ``log.interval`` steps (``runtime/train/tracking``). Other ranks construct it with
    ``enabled=False`` (every call is a no-op); constructing it is collective (a tracker that cannot start stops every
    rank)."""

    def __init__(
        self,
        log: Any,  # the config's ``log`` section
        total_steps: int,
        enabled: bool,
        run_config: dict[str, Any] | None = None,
        start_step: int = 0,
        samples_per_step: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled, self.total_steps = enabled, total_steps
        self.run = RunLog(log, total_steps, enabled, run_config, start_step, samples_per_step, stream)

    def log(self, m: StepMetrics, echo: bool = True) -> None:
        """Record every step to JSONL and the trackers; print it (and move the bar) when ``echo``."""
        if not self.enabled:
            return
        self.run.record(asdict(m))
        if not echo:
            return
        mfu = f" mfu {m.mfu:.1%}" if m.mfu is not None else ""
        skipped = f" skipped_nonfinite {m.skipped_nonfinite}" if m.skipped_nonfinite else ""
        evaluated = f" eval_loss {m.eval_loss:.4f}" if m.eval_loss is not None else ""
        line = (
            f"step {m.step:>5}/{self.total_steps} loss {m.loss:.4f}{evaluated} grad_norm {m.grad_norm:.3f} "
            f"lr {m.lr:.2e} tok/s {m.tokens_per_s:,.0f} tflops/dev {m.tflops_per_device:.3f}{mfu}{skipped}"
        )
        self.run.show(m.step, line, postfix=f"loss {m.loss:.4f}")

    def record(self, metrics: dict[str, Any]) -> None:
        """Other metrics of a step (``{"step": n, "eval_loss": ...}``) to the JSONL file and the trackers."""
        self.run.record(metrics)

    def say(self, line: str) -> None:
        self.run.say(line)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        """A file of the run (a validation sample) to the trackers."""
        self.run.log_file(tag, path, step)

    def finish(self, step: int) -> Path | None:
        """At the end of a run: ``<log.dir>/loss.png`` (this run's curves) written and sent to the trackers."""
        return self.run.plot(LOSS_PANELS, "loss.png", f"{self.run.log_dir.resolve().name}: training loss", step)

    def close(self) -> None:
        self.run.close()
