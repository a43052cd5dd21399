"""What the condition-model tests against a model's own diffusers pipeline share: a tiny pipeline directory around
an upstream transformer with random weights everywhere, the cached-context check and the Flow-GRPO rollout at noise
level 0 (the pipeline's ODE path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_tiny_pipeline(
    pipeline_class: type, condition_class: type, transformer_class: type, tiny: dict[str, Any], path: Path
) -> Path:
    """``pipeline_class`` of ``condition_class``'s tiny components and ``transformer_class(**tiny)``, saved at
    ``path``. Every transformer weight is perturbed: some layers start at zero, which would hide a wrong input."""
    torch.manual_seed(0)
    components = condition_class.tiny_components(tiny, None)
    transformer = transformer_class(**tiny)
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    pipeline_class(transformer=transformer, **components).save_pretrained(path)
    return path


def assert_cached_context_suffices(full: Any, bare: Any, x0: list[torch.Tensor], prompt: str) -> None:
    """A condition model loaded with ``encoders=False`` (a trainer reading the cache) has the full one's recipe:
    the same sampler, and ``process_condition`` the same inputs and target from the same cached context."""
    assert not bare.has_encoders and bare.sampler == full.sampler
    context = full.encode_prompts([prompt])
    ours = bare.process_condition(x0, context, torch.Generator().manual_seed(2))
    theirs = full.process_condition(x0, context, torch.Generator().manual_seed(2))
    for key, value in theirs.items():  # tensors, and plain values (LTX-Video's latent grid)
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value, key
    assert torch.equal(ours.target, theirs.target)


def ode_rollout(
    adapter: Any, transformer: torch.nn.Module, noise: torch.Tensor, prompt: str, negative: str, steps: int
):
    """The Flow-GRPO rollout of ``adapter`` at noise level 0 from ``noise``: every step the Euler ODE step."""
    from runtime.rl.sampling.rollout import rollout

    return rollout(
        adapter,
        transformer,
        adapter.encode([prompt], negative),
        latent_shape=adapter.latent_shape,
        num_inference_steps=steps,
        window_size=1,
        window_start_range=(0, 0),
        generators=[torch.Generator().manual_seed(3)],
        noise_level=0.0,
        initial_latents=noise.clone(),
    )
