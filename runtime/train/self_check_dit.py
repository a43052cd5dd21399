"""The start-up self-check of diffusion transformers (the ``dit`` family), for the trainer (``runtime.train``) and the
RL job (``runtime.rl``): ``runtime/train/self_check.py`` says why and what it compares.

The shrunk config: the job's transformer config (``to_diffuser_dict``: the diffusers ``__init__`` arguments) on the
spec's tiny config, with each of the spec's tiny variants whose branch the job turns on merged in first (a variant
key the tiny config lacks and the job sets: Wan's ``image_dim`` makes it image-to-video), by
``self_check_shrink``'s rule.

The proof's batch: per data-parallel replica, random latents and condition tensors in the shapes the job's condition
model hands the transformer (``runtime/diffusion/conditions/example_inputs.py``: token counts SP does not divide),
and a random target. Loss: the mean squared error of the prediction, divided by the replica count (each replica's
share of the global mean, as the trainer's step); under SP every rank computes the same loss from the gathered
prediction and the partial gradients add up over the group (``runtime/diffusion/sp.py``). The reference runs every
replica's inputs in turn in one process, fp32, accumulating gradients; the upstream diffusers class runs the same.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import replace
from typing import Any

import torch

from runtime.diffusion.conditions.example_inputs import example_inputs
from runtime.diffusion.registry import lookup_dit
from runtime.parallel.mixers import census
from runtime.parallel.parallelize import ParallelPlan, parallelize
from runtime.parallel.precision import compute_dtype
from runtime.parallel.state import ParallelState, parallel_state
from runtime.train.job import all_reduce_sum, to_device, train_device
from runtime.train.self_check import Comparison, Proof, compare, gradients, layout_text, tolerance
from runtime.train.self_check_power import DOUBLED_SHARE, planted_run
from runtime.train.self_check_power_dit import dit_defects
from runtime.train.self_check_shrink import ShrinkLayout, shrink_values

__all__ = ["prove_dit", "shrunk_dit_text", "shrunk_dit_values", "tiny_with_variants"]

SEED = 1234  # the proof's own weights, inputs and targets (the job's random streams are untouched)


def tiny_with_variants(entry: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The spec's tiny config with every tiny variant merged in whose branch the job turns on: a variant key the
    tiny config lacks (a trigger), set in the job (not None, False or empty). Of an active variant, the keys the tiny
    config has (its consistent companions: Wan I2V's ``in_channels``) and the triggers the job turns on are merged;
    a trigger the job leaves off is not (an SD3.5 job with ``qk_norm`` and no dual-attention layers is proven
    without them, as it runs)."""
    tiny = dict(entry.tiny)
    for variant in (entry.data.get("tiny_variants") or {}).values():
        on = {key for key in variant if key not in entry.tiny and job.get(key) not in (None, False, [], ())}
        if on:
            tiny.update({key: value for key, value in variant.items() if key in entry.tiny or key in on})
    return tiny


def shrunk_dit_values(model_type: str, job: dict[str, Any], state: ParallelState) -> dict[str, Any]:
    """The diffusers ``__init__`` arguments of the shrunk transformer."""
    entry = lookup_dit(model_type)
    layout = ShrinkLayout(head_split=state.ulysses_size)
    return shrink_values(job, tiny_with_variants(entry, job), layout)


def shrunk_dit_text(model: torch.nn.Module, values: dict[str, Any]) -> str:
    """What the self-check line says the shrunk transformer is ("4 blocks, 4 heads of 8"). DiTs name their sizes
    differently: the blocks are counted on the model (Flux's double and single blocks, Lumina2's refiners, AuraFlow's
    MMDiT and DiT layers each have a key of their own), and a config that names no head width (Lumina2) has
    ``hidden_size / num_attention_heads``."""
    from runtime.parallel.fsdp import block_modules

    heads = values.get("num_attention_heads")
    width = values.get("attention_head_dim")
    if width is None and heads and values.get("hidden_size"):
        width = values["hidden_size"] // heads
    return f"{len(block_modules(model))} blocks, {heads} heads of {width}"


def _loss_and_backward(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    target: torch.Tensor,
    replicas: int,
    device: torch.device,
    scale: float = 1.0,
    backward: bool = True,
) -> torch.Tensor:
    """This replica's share of the global mean squared error, backpropagated (``scale``: the planted doubled share;
    ``backward=False``: the share alone)."""
    with warnings.catch_warnings():  # FSDP2 warns that unpatchify's view is returned: no in-place op follows
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        prediction = model(**to_device(inputs, device))[0]
    loss = (prediction.float() - target.to(device)).pow(2).mean() / replicas * scale
    if backward:
        loss.backward()
    return loss.detach()


def _one_process(
    model: torch.nn.Module, batches: list[dict[str, Any]], targets: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every replica's batch in turn, gradients accumulated: the loss and gradients of the global mean."""
    model.to(device).train()
    loss = sum(_loss_and_backward(model, b, t, len(batches), device) for b, t in zip(batches, targets, strict=True))
    return loss, gradients(model)


def prove_dit(
    model_type: str,
    plan: ParallelPlan,
    state: ParallelState,
    job_config: Any,
    model_class: type | None = None,
    upstream_class: type | None = None,
) -> Proof:
    """The proof of a DiT job (the module docstring): ``job_config`` is the built transformer's config, ``plan``
    what the job asks of ``parallelize``. ``model_class`` / ``upstream_class`` replace the registry's classes (tests
    plant defects through them)."""
    entry = lookup_dit(model_type)
    model_class = model_class or entry.model_class()
    upstream_class = upstream_class or entry.upstream_class()
    values = shrunk_dit_values(model_type, job_config.to_diffuser_dict(), state)
    backend = getattr(job_config, "attention_backend", None)
    device = train_device(state)
    batches = [
        example_inputs(entry.data["condition_model_type"], values, torch.Generator().manual_seed(SEED + d))
        for d in range(state.dp_size)
    ]
    torch.manual_seed(SEED)
    model = model_class(model_class.config_class(**values, attention_backend=backend))
    shrunk = shrunk_dit_text(model, values)
    initial = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)
    with parallel_state(ParallelState()), torch.no_grad():  # the targets: shaped like the prediction
        reference.to(device)  # the job's device: its attention backend may not run elsewhere
        shapes = [reference(**to_device(b, device))[0].shape for b in batches]
        if state.sp_enabled:  # the sequence mixers the layout's site check watches (whatever their class name)
            run = functools.partial(reference, **to_device(batches[0], device))
            plan = replace(plan, mixer_classes=census(reference, run, exempt=plan.replicated_modules))
    targets = [torch.randn(s, generator=torch.Generator().manual_seed(SEED + 100 + d)) for d, s in enumerate(shapes)]
    comparisons: list[Comparison] = []
    with parallel_state(ParallelState()):  # one process, fp32, the generated class: the reference
        ref_loss, ref_grads = _one_process(reference, batches, targets, device)
        upstream = upstream_class(**values)
        upstream.load_state_dict(initial)
        if backend:
            upstream.set_attention_backend(backend)
        up_loss, up_grads = _one_process(upstream, batches, targets, device)
        what = f"generated vs upstream {entry.upstream_auto} (one process, fp32)"
        comparisons.append(compare(what, up_loss, up_grads, ref_loss, ref_grads, tolerance(torch.float32)))
    del reference, upstream

    planted: list[Comparison] = []
    advisory: dict[str, str] = {}
    if state.world_size > 1:  # the job's layout against one process
        model = parallelize(model, state, plan, device)
        model.train()
        dtype = compute_dtype(plan.mixed_precision, state.device_type)

        def step(backward: bool = True, doubled: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            model.zero_grad(set_to_none=True)
            scale = 2.0 if doubled and state.dp_rank == state.dp_size - 1 else 1.0
            inputs, target = batches[state.dp_rank], targets[state.dp_rank]
            share = _loss_and_backward(model, inputs, target, state.dp_size, device, scale, backward)
            grads = gradients(model) if backward else {}
            return all_reduce_sum(share, state.dp_group), grads  # SP ranks hold the same share

        layout = layout_text(state, plan.mixed_precision, dtype, plan.activation_checkpointing)
        comparisons.append(compare(f"{layout} vs one process", *step(), ref_loss, ref_grads, tolerance(dtype)))
        for defect in dit_defects(state, model):
            planted.append(planted_run(defect, model, step, ref_loss, ref_grads, tolerance(dtype), state.loss_group))
            advisory.update({defect.name: defect.advisory} if defect.advisory else {})
        if state.dp_size > 1:
            planted.append(compare(DOUBLED_SHARE, *step(doubled=True), ref_loss, ref_grads, tolerance(dtype)))
    return Proof(shrunk, comparisons, planted, advisory, plan.mixer_classes)
