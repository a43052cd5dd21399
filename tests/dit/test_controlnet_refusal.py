"""ControlNet residuals, which the forward adds to every image token block by block and the token split does not
slice, are refused at the first SP forward, naming the spec's patch (Flux's two inputs, Qwen-Image's, SD3's): upstream
would add a whole image's residuals to one rank's slice. Each model is its generated trainable class at SP=2 (gloo)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.dit.cases import CASES, inputs, shell

ALL_RESIDUALS = {
    "flux": ("FluxTransformer2DModel", ["controlnet_block_samples", "controlnet_single_block_samples"]),
    "qwenimage": ("QwenImageTransformer2DModel", ["controlnet_block_samples"]),
    "sd3": ("SD3Transformer2DModel", ["block_controlnet_hidden_states"]),
}
# the models generated here (`upgrade --verify` runs tests/dit in a tree holding only the models it proves)
RESIDUALS = {k: v for k, v in ALL_RESIDUALS.items() if any(c.model_type == k for c in CASES.values())}


def _errors(rank: int, world_size: int) -> list[str]:
    import torch

    from runtime.parallel.state import init_parallel_state

    init_parallel_state(sp_size=world_size)
    out = []
    for model_type, (_, names) in RESIDUALS.items():
        case = next(c for c in CASES.values() if c.model_type == model_type and c.variant is None)
        model = shell(case)
        for name in names:
            try:
                model(**inputs(case), **{name: [torch.ones(1)]})
            except ValueError as exc:
                out.append(str(exc))
            else:
                out.append("no error")
    return out


@pytest.mark.dist
def test_controlnet_residuals_are_refused_under_sp() -> None:
    reason = "ControlNet residuals are whole-image tensors the token split does not slice; train with sp=1"
    expected = [
        f"sequence parallelism cannot run this configuration (specs/{model_type}.toml patch {number} "
        f"(dit/refuse_under_sp in {cls}.forward)): {reason}"
        for model_type, (cls, names) in RESIDUALS.items()
        for number in range(1, len(names) + 1)
    ]
    for messages in run_distributed(_errors, 2, timeout=300):
        assert messages == expected
