"""Step metrics: loss, grad norm, lr, tokens/s, model TFLOP/s and MFU, steps skipped as non-finite, to the console,
``metrics.jsonl`` and the trackers of ``log.report_to`` (``runtime/train/tracking``), and the loss curve at the end."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.train.tracking.plots import Panel
from runtime.train.tracking.run_log import MetricsSink

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Dense bf16 peak TFLOP/s per device, for MFU when the config does not give one.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def detect_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _first(config: Any, *names: str) -> Any:
    """The first of ``names`` the config sets (model families name the same size differently)."""
    return next((value for name in names if (value := getattr(config, name, None))), None)


def _mlp_params(config: Any) -> int:
    """Matmul parameters of the MLPs one token runs through, summed over the layers, from what the config has:
    dense (``intermediate_size``) or MoE (the top-k routed experts of ``moe_intermediate_size``, or
    ``intermediate_size`` where that is the expert's size as in gpt_oss; the router over ``num_experts`` /
    ``num_local_experts`` / ``n_routed_experts``; shared experts; the leading dense layers of
    ``first_k_dense_replace``)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    dense = 3 * hidden * config.intermediate_size
    top_k, experts = getattr(config, "num_experts_per_tok", None), _first(config, *EXPERT_COUNTS)
    if not (top_k and experts):
        return layers * dense
    expert = _first(config, "moe_intermediate_size", "intermediate_size")
    shared = (getattr(config, "n_shared_experts", None) or 0) * expert
    shared = shared or getattr(config, "shared_expert_intermediate_size", None) or 0
    sparse = 3 * hidden * (expert * top_k + shared) + hidden * experts
    dense_layers = min(getattr(config, "first_k_dense_replace", None) or 0, layers)
    return dense_layers * dense + (layers - dense_layers) * sparse


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _matmul_params(config: Any) -> int:
    """Non-embedding matmul parameters a token runs through: q/k/v/o and the MLPs (``_mlp_params``) per layer, and
    the LM head."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * attn + _mlp_params(config) + hidden * config.vocab_size


def causal_lm_flops(config: PretrainedConfig, lengths: Iterable[int]) -> float:
    """Training FLOPs (fwd+bwd) of documents of ``lengths`` tokens: 6 x matmul params per token, and causal
    attention scores inside each document, 6 x layers x heads x head_dim x L**2 for a document of L tokens (half of
    the full 12x because of the causal mask; packed documents do not attend to each other)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_pair = 6.0 * config.num_hidden_layers * heads * head_dim
    lengths = list(lengths)
    return 6.0 * _matmul_params(config) * sum(lengths) + per_pair * sum(n * n for n in lengths)


def flops_per_token(config: PretrainedConfig, seq_len: int) -> float:
    """Training FLOPs per token of one document of ``seq_len`` tokens (``causal_lm_flops``)."""
    return causal_lm_flops(config, [seq_len]) / seq_len


def document_lengths(position_ids: torch.Tensor) -> list[int]:
    """The lengths of the documents packed in one row, from its position ids (``(L,)``, ``(1, L)``, or a
    multimodal ``(C, 1, L)`` whose first channel is the text row): each document restarts its positions at 0
    (``runtime/data/text/packing.py``)."""
    text = position_ids[0] if position_ids.ndim == 3 else position_ids
    text = text.reshape(-1).cpu()
    starts = torch.nonzero(text == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [end - start for start, end in zip(starts, [*starts[1:], text.numel()], strict=True)]


def step_flops(config: PretrainedConfig, rows: Sequence[Mapping[str, Any]]) -> float:
    """Training FLOPs of packed ``rows`` (their real tokens, not the token budget): ``causal_lm_flops`` of every
    document of every row."""
    return sum(causal_lm_flops(config, document_lengths(row["position_ids"])) for row in rows)


def tflops_per_device(flops: float, seconds: float, devices: int) -> float:
    """Model TFLOP/s per device of a step of ``flops`` (the whole job's) that took ``seconds`` on ``devices``."""
    return flops / seconds / devices / 1e12


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


class MetricsLogger(MetricsSink):
    """Rank-0 sink of the trainer: every step to ``<log.dir>/metrics.jsonl`` and the trackers of ``log.report_to``,
    a console line every ``log.interval`` steps (``runtime/train/tracking``). Other ranks construct it with
    ``enabled=False`` (every call is a no-op); constructing it is collective (a tracker that cannot start stops every
    rank)."""

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
            f"lr {m.lr:.2e} tok/s {m.tokens_per_s:,.0f} tflops/dev {m.tflops_per_device:.3g}{mfu}{skipped}"
        )
        self.run.show(m.step, line, postfix=f"loss {m.loss:.4f}")

    def record(self, metrics: dict[str, Any]) -> None:
        """Other metrics of a step (``{"step": n, "eval_loss": ...}``) to the JSONL file and the trackers."""
        self.run.record(metrics)

    def log_file(self, tag: str, path: Path, step: int) -> None:
        """A file of the run (a validation sample) to the trackers."""
        self.run.log_file(tag, path, step)

    def finish(self, step: int) -> Path | None:
        """At the end of a run: ``<log.dir>/loss.png`` (this run's curves) written and sent to the trackers."""
        return self.run.plot(LOSS_PANELS, "loss.png", f"{self.run.log_dir.resolve().name}: training loss", step)
