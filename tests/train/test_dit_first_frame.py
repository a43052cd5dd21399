"""Wan2.2 TI2V's first-frame conditioning in training (``runtime/diffusion/conditions/wan.py``,
``runtime/train/dit_step.py``): the first latent frame is the image's clean latents, its tokens get timestep 0, and
the loss covers the other frames only. The trainer at sp=2 on this case is ``tests/train/test_dit_models.py``
(case ``wan_ti2v``)."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.tiny_pipelines import save_tiny_pipeline
from runtime.train.dit_step import weighted_flow_matching_loss


def test_ti2v_first_frame_is_given_at_timestep_zero_and_left_out_of_the_loss(tmp_path: Path) -> None:
    cm = load_condition_model("wan", save_tiny_pipeline("wan_ti2v", tmp_path / "pipe"))
    assert cm.expand_timesteps and cm.i2v
    video = torch.rand(3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    cond = cm.get_condition(["a boat"], [video])
    first = cond["context"][0]["first_frame_latents"]
    inputs = cm.process_condition(cond["latents"], cond["context"], torch.Generator().manual_seed(1))
    x = inputs["hidden_states"]  # (1, C, 2, 4, 4): 2 latent frames of 2x2 tokens
    assert torch.equal(x[0][:, :1], first)
    assert inputs["timestep"].shape == (1, 8)
    assert (inputs["timestep"][0, :4] == 0).all() and (inputs["timestep"][0, 4:] == inputs.sigmas * 1000).all()
    mask = inputs.loss_mask
    assert mask.shape == inputs.target.shape and (mask[:, :, 0] == 0).all() and (mask[:, :, 1:] == 1).all()

    prediction = torch.randn(inputs.target.shape, generator=torch.Generator().manual_seed(2))
    loss = weighted_flow_matching_loss(prediction, inputs, cm, seq_len=8, denominator=1)
    rest = (prediction - inputs.target)[:, :, 1:].pow(2).mean()
    expected = cm.loss_weight(inputs.sigmas, 8) * rest
    assert torch.allclose(loss, expected.sum(), rtol=1e-6)  # float32 sums in another order: rounding only
