"""The PixArt-Sigma condition model and the DDPM objective (``runtime/diffusion/ddpm.py``) against diffusers' own
``DDPMScheduler`` and the loss of diffusers' PixArt training scripts, on a tiny ``PixArtSigmaPipeline`` saved and
loaded with the real loading code (upstream transformer, no spec):

* the forward process: ``process_condition``'s noisy latents are ``DDPMScheduler.add_noise`` of the latents, the noise
  and the integer timesteps it reports, bitwise, for PixArt-Sigma's released betas; the noise level it reports is
  ``sqrt(1 - abar_t)``; ``t = floor(u T)`` never reaches ``T``;
* the learned variance: the target is the noise in the output's first half, and the loss the trainer computes from
  the loss mask is the scripts' ``mse(model_pred.chunk(2, dim=1)[0], noise)`` within the rounding model, with its
  gradient, while the variance half of the output gets exactly none;
* v-prediction's target is ``DDPMScheduler.get_velocity``; ``sample`` prediction, PixArt-Alpha's resolution
  conditions and sampler options the recipe has no use for are refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DDPMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.conditions.pixart_sigma import PixArtSigmaConditionModel
from runtime.diffusion.ddpm import DDPMObjective
from runtime.diffusion.timesteps import TimestepSampler
from runtime.train.dit_step import weighted_flow_matching_loss
from tests.conditions.common import save_tiny_pipeline
from tests.tolerance import assert_within_rounding

# the tiny transformer (specs/pixart_sigma.toml's [model.tiny]): 4 heads of 8, a learned variance (8 = 2 x 4 channels)
TINY: dict[str, Any] = {
    "num_attention_heads": 4,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 8,
    "num_layers": 2,
    "cross_attention_dim": 32,
    "caption_channels": 32,
    "sample_size": 32,
    "patch_size": 2,
}
# PixArt-Sigma's released scheduler config (scheduler/scheduler_config.json of PixArt-Sigma-XL-2-1024-MS)
BETAS = {"beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear", "num_train_timesteps": 1000}
PROMPTS = ["a small boat on a quiet lake", "red"]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_pipeline(
        PixArtSigmaPipeline,
        PixArtSigmaConditionModel,
        PixArtTransformer2DModel,
        TINY,
        tmp_path_factory.mktemp("pixart_sigma"),
    )


@pytest.fixture(scope="module")
def cm(directory: Path) -> PixArtSigmaConditionModel:
    model = load_condition_model("pixart_sigma", directory)
    assert isinstance(model, PixArtSigmaConditionModel)
    return model


def _batch(cm: PixArtSigmaConditionModel, seed: int = 3) -> tuple[torch.Tensor, Any]:
    x0 = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    inputs = cm.process_condition(list(x0), cm.encode_prompts(PROMPTS), torch.Generator().manual_seed(seed))
    return x0, inputs


def test_noisy_latents_are_the_ddpm_schedulers_forward_process(cm: PixArtSigmaConditionModel) -> None:
    x0, inputs = _batch(cm)
    t = inputs["timestep"]
    assert t.dtype == torch.int64 and t.shape == (2,) and ((0 <= t) & (t < 1000)).all()
    noise, variance = inputs.target.chunk(2, dim=1)
    scheduler = DDPMScheduler(**BETAS)
    assert torch.equal(inputs["hidden_states"], scheduler.add_noise(x0, noise, t))
    assert torch.equal(inputs.sigmas, (1 - scheduler.alphas_cumprod[t]).sqrt())
    assert torch.equal(variance, torch.zeros_like(variance)) and noise.std() > 0.5
    assert torch.equal(inputs.loss_mask, torch.cat([torch.ones_like(noise), torch.zeros_like(noise)], dim=1))
    assert inputs["added_cond_kwargs"] == {"resolution": None, "aspect_ratio": None}
    # t = floor(u T): u just below 1 is the last timestep, never T
    u = torch.tensor([0.0, 0.0009, 0.001, 0.5, 0.99999994])
    assert cm.objective.timesteps(u).tolist() == [0, 0, 1, 500, 999]


def test_loss_is_the_scripts_and_the_variance_half_gets_no_gradient(
    cm: PixArtSigmaConditionModel, directory: Path
) -> None:
    """The trainer's masked loss against diffusers' PixArt scripts' ``F.mse_loss(model_pred.chunk(2, 1)[0], noise)``
    (witness: the scripts' loss in float64), the loss and its gradient with respect to the output."""
    _, inputs = _batch(cm, seed=5)
    transformer = PixArtTransformer2DModel.from_pretrained(directory, subfolder="transformer")
    with torch.no_grad():
        output = transformer(**inputs, return_dict=False)[0]
    assert output.shape == inputs.target.shape == (2, 8, 4, 6)
    noise = inputs.target[:, :4]

    def scripts(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        pred = output.to(dtype, copy=True).requires_grad_()
        loss = torch.nn.functional.mse_loss(pred.chunk(2, dim=1)[0], noise.to(dtype), reduction="mean")
        loss.backward()
        return {"loss": loss.detach(), "grad": pred.grad}

    pred = output.detach().clone().requires_grad_()
    loss = weighted_flow_matching_loss(pred, inputs, cm, seq_len=6, denominator=2)
    loss.backward()
    assert torch.equal(pred.grad[:, 4:], torch.zeros_like(pred.grad[:, 4:]))
    assert (pred.grad[:, :4] != 0).all()
    assert_within_rounding(
        {"loss": loss.detach(), "grad": pred.grad}, scripts(torch.float32), scripts(torch.float64), what="loss"
    )


def test_v_prediction_target_is_the_velocity_and_sample_prediction_is_refused() -> None:
    objective = DDPMObjective.from_configs({**BETAS, "prediction_type": "v_prediction"}, {"in_channels": 4})
    assert not objective.learned_variance
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 4, 6, generator=gen), torch.randn(3, 4, 4, 6, generator=gen)
    t = torch.tensor([0, 417, 999])
    noisy, target, mask = objective.noisy_and_target(x0, noise, t)
    scheduler = DDPMScheduler(**BETAS, prediction_type="v_prediction")
    assert mask is None and torch.equal(noisy, scheduler.add_noise(x0, noise, t))
    assert torch.equal(target, scheduler.get_velocity(x0, noise, t))
    with pytest.raises(ValueError, match=r"^scheduler/scheduler_config.json: prediction_type 'sample' is not trained"):
        DDPMObjective.from_configs({**BETAS, "prediction_type": "sample"}, {"in_channels": 4})


def test_resolution_conditions_and_foreign_sampler_options_are_refused(directory: Path) -> None:
    pipeline = PixArtSigmaConditionModel.load_pipeline(directory, encoders=False)
    with pytest.raises(ValueError, match="use_additional_conditions is true") as refused:
        PixArtSigmaConditionModel(pipeline, TimestepSampler(), {**TINY, "use_additional_conditions": True})
    assert "\n" not in str(refused.value)
    for option in ({"shift": 3.0}, {"weighting": "bell"}, {"low": 0.5}):
        with pytest.raises(ValueError, match=f"^{next(iter(option))}: not part of PixArt-Sigma's DDPM recipe"):
            load_condition_model("pixart_sigma", directory, encoders=False, **option)
    bare = load_condition_model("pixart_sigma", directory, encoders=False, distribution="logit_normal")
    assert bare.sampler == TimestepSampler(distribution="logit_normal") and not bare.has_encoders


PLAN = Path(__file__).resolve().parents[2] / "runtime" / "plan" / "configs" / "pixart-sigma-xl-2-1024-ms.yaml"


def test_plan_config_names_every_parameter_but_the_unused_ones() -> None:
    """The plan file states PixArt-Sigma XL/2's transformer config: every key is a parameter of the diffusers class,
    and the ones it leaves out keep their defaults (the 2-D transformer's options PixArt never turns on)."""
    import inspect

    import yaml

    config = yaml.safe_load(PLAN.read_text())["model"]["config"]
    signature = inspect.signature(PixArtTransformer2DModel.__init__).parameters
    assert set(config) <= set(signature) - {"self"}
    left_out = set(signature) - {"self"} - set(config)
    assert all(signature[k].default in (None, False) for k in left_out), left_out


def test_plan_inputs_fit_the_transformer_and_the_plan_runs() -> None:
    """``dit_inputs``' pixart_sigma branch (8x VAE, unpacked latents, patch 2, a T5 mask of ones, no resolution
    conditions) on a small workload and the tiny config: the upstream transformer takes them and returns the learned
    variance's doubled channels; the token count is its patchify's. The plan file reads and fits on 8 GPUs."""
    from diffusers.configuration_utils import FrozenDict

    from runtime.plan.config import PlanModel, Workload, read_plan
    from runtime.plan.dit_inputs import dit_inputs

    inputs, tokens = dit_inputs(
        PlanModel(type="pixart_sigma"), FrozenDict(TINY), Workload(height=64, width=96, text_tokens=9)
    )
    assert inputs["hidden_states"].shape == (1, TINY["in_channels"], 8, 12) and tokens == 4 * 6
    assert inputs["encoder_hidden_states"].shape == (1, 9, TINY["caption_channels"])
    torch.manual_seed(0)
    out = PixArtTransformer2DModel(**TINY)(**inputs)[0]
    assert out.shape == (1, TINY["out_channels"], 8, 12)
    plan = read_plan(PLAN)
    assert plan.model.type == "pixart_sigma" and plan.workload.text_tokens == 300
