"""The Flow-GRPO adapter of the generated DiTs against their own diffusers pipelines (tiny random pipelines saved
to a temp dir, real loading code):

* the schedule the rollout uses is the one the pipeline's scheduler holds after a real pipeline call (Flux and
  Qwen-Image pass their own ``sigmas`` and a resolution shift ``mu``: the scheduler's grid would be another one);
* a rollout at noise level 0 from the pipeline's initial latents ends where the pipeline ends (true CFG with the
  negative prompt for Wan and Qwen-Image, the guidance embedding for Flux);
* the registry answers for every generated DiT (it used to know only SD3 and the BAGEL-style model).
"""

from __future__ import annotations

import pytest
import torch

from runtime.diffusion.conditions import load_condition_model
from runtime.diffusion.registry import lookup_dit, training_class
from runtime.rl.adapters.dit import DiTFlowGRPO, adapter_for
from runtime.rl.adapters.registry import get_diffusion_model_cls
from runtime.rl.sampling.rollout import rollout

PROMPT = "a red kite over green hills"
# name -> (pipeline call arguments, adapter true_cfg_scale, negative prompt, pixel size (frames, height, width))
CASES = {
    "wan": ({"guidance_scale": 3.0, "num_frames": 5}, 3.0, "", (5, 32, 32)),
    "flux": ({"guidance_scale": 3.5}, 1.0, None, (None, 32, 48)),
    "qwenimage": ({"true_cfg_scale": 2.5, "negative_prompt": "blurry"}, 2.5, "blurry", (None, 32, 48)),
    "sd3": ({"guidance_scale": 3.0}, 3.0, "", (None, 32, 48)),
    "hunyuanvideo": (
        {"num_frames": 5, "guidance_scale": 1.0, "true_cfg_scale": 2.0, "negative_prompt": "blurry"},
        2.0,
        "blurry",
        (5, 32, 32),
    ),
}
VIDEO = ("wan", "hunyuanvideo")
PACKED = ("flux", "qwenimage")  # pipelines that take and return packed latents
STEPS = 3


def _setup(name, tiny_pipelines):
    path = tiny_pipelines(name)
    cm = load_condition_model(lookup_dit(name).data["condition_model_type"], path)
    module = training_class(name).from_pretrained(path, subfolder="transformer").eval()
    _, cfg, negative, (frames, height, width) = CASES[name]
    shape = cm.sampling_latent_shape(height, width, frames)
    adapter = adapter_for(name)(cm, shape, true_cfg_scale=cfg, noise_level=0.0)
    return path, cm, module, adapter, negative


def _pipeline_call(name, path, module, latents):
    from runtime.checkpoint.diffusers_export import pipeline_class

    call, _, _, (frames, height, width) = CASES[name]
    pipe = pipeline_class(path).from_pretrained(path, transformer=module)
    pipe.set_progress_bar_config(disable=True)
    if name in PACKED:
        b, c, h, w = latents.shape
        latents = pipe._pack_latents(latents, b, c, h, w)
    out = pipe(
        prompt=PROMPT,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        latents=latents,
        output_type="latent",
        **call,
    )
    return pipe, out.frames if name in VIDEO else out.images


@pytest.mark.parametrize("name", sorted(CASES))
def test_rollout_schedule_and_ode_path_are_the_pipelines(name, tiny_pipelines):
    path, cm, module, adapter, negative = _setup(name, tiny_pipelines)
    batch = adapter.encode([PROMPT], negative)
    res = rollout(
        adapter,
        module,
        batch,
        latent_shape=adapter.latent_shape,
        num_inference_steps=STEPS,
        window_size=1,
        window_start_range=(0, 0),  # res.latents[:, 0] is the initial noise
        generators=[torch.Generator().manual_seed(3)],
        noise_level=0.0,
    )
    with torch.no_grad():
        pipe, final = _pipeline_call(name, path, module, res.latents[:, 0].clone())
    schedule = adapter.set_timesteps(STEPS)
    assert torch.equal(schedule.sigmas, pipe.scheduler.sigmas.float()), (schedule.sigmas, pipe.scheduler.sigmas)
    assert torch.equal(schedule.timesteps, pipe.scheduler.timesteps.float())
    ours = res.final_latents
    if name in PACKED:
        b, c, h, w = ours.shape
        ours = pipe._pack_latents(ours, b, c, h, w)
    err = ((ours.double() - final.double()).norm() / final.double().norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("name", ["wan", "flux", "qwenimage", "hunyuanvideo"])
def test_every_generated_dit_has_an_adapter(name):
    architecture = lookup_dit(name).upstream_auto
    cls = get_diffusion_model_cls(architecture)
    assert issubclass(cls, DiTFlowGRPO) and cls.model_type == name and cls is adapter_for(name)


def test_an_architecture_with_its_own_adapter_keeps_it():
    """The library's SD3 adapter keeps "SD3Transformer2DModel" whether or not an SD3 spec is
    generated; the job finds a generated SD3 by its model type."""
    from runtime.diffusion.registry import dit_model_types
    from runtime.rl.adapters.sd3 import SD3FlowGRPO

    assert get_diffusion_model_cls("SD3Transformer2DModel") is SD3FlowGRPO
    if "sd3" in dit_model_types():
        assert adapter_for("sd3").model_type == "sd3"
