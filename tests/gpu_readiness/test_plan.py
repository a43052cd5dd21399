"""``python -m runtime.plan``: its activation estimate (fake tensors) against the measured peak of real CPU runs of
small configs (text, MoE, DiT, Lumina2's DiT whose RoPE reads the caption lengths to the host; with and without
activation checkpointing), within 15%; the command's user errors.

Measured peak: the bytes glibc's malloc holds during one forward+backward (``runtime.plan.peak.MallocPeak``, sampled
after every op) above what it held before, minus the parameter gradients accumulated so far, which is what the
plan's ``Footprint.peak`` counts. fp32 on both sides; attention without GQA and without a mask (one causal sequence;
Lumina2's caption refiner passes its key mask of ones), so torch's CPU SDPA takes its flash kernel, which saves what
flash-attention saves on a GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from runtime.parallel.fsdp import apply_activation_checkpointing
from runtime.plan.__main__ import main
from runtime.plan.config import PlanConfig, PlanModel, Workload
from runtime.plan.footprint import Footprint, build_model, measure
from runtime.plan.layout import Layout, per_rank, smallest_fitting
from runtime.plan.peak import MallocPeak

TOLERANCE = 0.15
LM = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
    vocab_size=4096,
    max_position_embeddings=8192,
)
MOE = {**LM, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4}
CASES = {
    "text": PlanConfig(
        PlanModel("qwen3", config={**LM, "use_sliding_window": False}), Workload(tokens=2048, loss_chunk_size=512)
    ),
    "moe": PlanConfig(
        PlanModel(
            "qwen3_moe", config={**LM, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4}
        ),
        Workload(tokens=2048, loss_chunk_size=512),
    ),
    "dit": PlanConfig(
        PlanModel(
            "wan",
            config=dict(
                patch_size=(1, 2, 2),
                num_attention_heads=8,
                attention_head_dim=36,
                in_channels=16,
                out_channels=16,
                text_dim=64,
                freq_dim=64,
                ffn_dim=768,
                num_layers=4,
                rope_max_seq_len=256,
            ),
        ),
        Workload(frames=17, height=256, width=256, text_tokens=64),  # 5 x 16 x 16 = 1280 tokens
    ),
    # its rope_embedder reads the caption lengths to the host: the plan runs it on real tensors (host_reads)
    "lumina2": PlanConfig(
        PlanModel(
            "lumina2",
            config=dict(
                patch_size=2,
                in_channels=16,
                hidden_size=256,
                num_layers=4,
                num_refiner_layers=1,
                num_attention_heads=8,
                num_kv_heads=8,
                multiple_of=64,
                axes_dim_rope=[8, 12, 12],
                cap_feat_dim=64,
            ),
        ),
        Workload(height=512, width=512, text_tokens=64),  # 32 x 32 = 1024 image tokens, joined with 64 caption
    ),
}
DITS = ("wan", "lumina2")


def _real_model(plan: PlanConfig) -> torch.nn.Module:
    """The generated model the trainer runs: sdpa attention, the grouped experts; random fp32 weights."""
    from runtime.moe.dispatch import register_experts_kernels

    torch.manual_seed(0)
    if plan.model.type in DITS:
        return build_model(plan)
    import transformers

    from runtime.models.registry import lookup

    register_experts_kernels()
    entry = lookup(plan.model.type)
    config = transformers.AutoConfig.for_model(plan.model.type, **plan.model.config, use_cache=False)
    config._attn_implementation = "sdpa"
    if entry.is_moe:
        config._experts_implementation = "patchgen_grouped"
    return entry.model_class()(config)


def _real_inputs(plan: PlanConfig, model: torch.nn.Module) -> dict:
    g = torch.Generator().manual_seed(1)
    if plan.model.type in DITS:
        from runtime.plan.dit_inputs import dit_inputs

        shapes, _ = dit_inputs(plan.model, model.config, plan.workload)
        kept = ("timestep", "encoder_attention_mask")  # the mask of ones: every caption token real
        return {
            k: torch.randn(v.shape, generator=g) if isinstance(v, torch.Tensor) and k not in kept else v
            for k, v in shapes.items()
        }
    ids = torch.randint(1, model.config.vocab_size, (1, plan.workload.tokens), generator=g)
    return {"input_ids": ids, "labels": ids, "loss_chunk_size": plan.workload.loss_chunk_size}


def _measured_peak(plan: PlanConfig, checkpointing: bool) -> int:
    model = _real_model(plan)
    model.train()
    if checkpointing:
        apply_activation_checkpointing(model)
    inputs = _real_inputs(plan, model)
    grads = [0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(0, grads[0] + p.grad.nbytes))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no per-thread scratch buffers in the figure
    try:
        with MallocPeak(offset=lambda: grads[0]) as tracker:
            out = model(**inputs)
            loss = out.loss if getattr(out, "loss", None) is not None else out[0].square().mean()
            loss.backward()
    finally:
        torch.set_num_threads(threads)
    return tracker.peak - tracker.base


@pytest.fixture(scope="module")
def footprints() -> dict[str, Footprint]:
    return {name: measure(plan, torch.float32) for name, plan in CASES.items()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
@pytest.mark.parametrize("name", list(CASES))
def test_activation_estimate_within_15_percent_of_measured_peak(footprints, name: str, checkpointing: bool) -> None:
    estimate = footprints[name].peak_checkpointed if checkpointing else footprints[name].peak
    measured = _measured_peak(CASES[name], checkpointing)
    print(
        f"{name} checkpointing={checkpointing}: estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f}"
    )
    assert abs(estimate / measured - 1) <= TOLERANCE, (name, checkpointing, estimate / 2**20, measured / 2**20)


def test_footprint_counts_parameters_and_experts(footprints) -> None:
    fp = footprints["moe"]
    real = _real_model(CASES["moe"])
    assert fp.params == sum(p.numel() for p in real.parameters())
    assert fp.experts == 16 and fp.expert_params == 4 * 16 * 3 * 256 * 128
    assert fp.heads == 8 and fp.tokens == 2048 and footprints["dit"].tokens == 1280
    assert footprints["lumina2"].params == sum(p.numel() for p in _real_model(CASES["lumina2"]).parameters())
    assert footprints["lumina2"].tokens == 1024 and len(footprints["lumina2"].saved_blocks) == 4 + 2


def test_layout_search_takes_the_cheapest_layout_that_fits(footprints) -> None:
    fp = footprints["text"]
    whole = per_rank(fp, Layout(1, 1)).total
    layout, memory = smallest_fitting(fp, 8, whole / 0.9)  # everything fits on one rank: no parallelism needed
    assert layout == Layout(8, 1) and memory.total <= whole
    layout, _ = smallest_fitting(fp, 8, per_rank(fp, Layout(1, 4, sp=2)).total / 0.9)
    assert layout.sp == 2 and not layout.activation_checkpointing  # sp=2 before checkpointing
    assert smallest_fitting(fp, 8, 1.0) is None


def test_help_imports_no_torch() -> None:
    code = (
        "import sys\nfrom runtime.plan.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--gpu-mem" in done.stdout


def test_bad_plan_file_is_one_line_exit_2(tmp_path, capsys) -> None:
    bad = tmp_path / "plan.yaml"
    bad.write_text("model: {type: qwen3}\nworkload: {tokens: 0}\n")
    assert main([str(bad), "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "workload.tokens" in err and str(bad) in err
    bad.write_text("model: {type: qwen3}\nworkload: {tokens: 64}\nparalel: {sp: 2}\n")
    assert main([str(bad)]) == 2
    assert "paralel" in capsys.readouterr().err
    bad.write_text("model: {type: no_such_model}\nworkload: {tokens: 64}\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_model" in err
