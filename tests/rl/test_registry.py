import pytest
import torch
from torch import nn

from runtime.rl.adapters.registry import (
    DiffusionModelBase,
    get_diffusion_model_cls,
    register_diffusion_model,
    registered_diffusion_models,
    unregister_diffusion_model,
)
from runtime.rl.sampling.scheduler import make_schedule, sde_step


class _Toy(DiffusionModelBase):
    def build_scheduler(self, config):
        return {"shift": 3.0}

    def set_timesteps(self, num_inference_steps, **kwargs):
        return make_schedule(self.build_scheduler(None), num_inference_steps)

    def prepare_model_inputs(self, batch, latents, step_index):
        return {"input": latents}

    def forward_and_sample_previous_step(self, module, batch, latents, step_index, **kwargs):
        v = module(**self.prepare_model_inputs(batch, latents, step_index))
        _, lp, mean, std, sqrt_dt = sde_step(batch["schedule"], latents, v, step_index=step_index, **kwargs)
        return lp, mean, std, sqrt_dt


@pytest.fixture
def toy():
    cls = register_diffusion_model("ToyArch")(_Toy)
    yield cls
    unregister_diffusion_model("ToyArch")


def test_register_and_get(toy):
    assert get_diffusion_model_cls("ToyArch") is toy
    assert "ToyArch" in registered_diffusion_models()
    assert toy.architecture == "ToyArch"
    adapter = toy()
    module = nn.Linear(4, 4)
    sched = adapter.set_timesteps(6)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    lp, mean, std, sqrt_dt = adapter.forward_and_sample_previous_step(
        module, {"schedule": sched}, x, 2, noise_level=0.7, generator=torch.Generator().manual_seed(1)
    )
    assert lp.shape == (2,) and mean.shape == (2, 4) and std.shape == sqrt_dt.shape == (2, 1)


def test_unknown_key_lists_registered(toy):
    with pytest.raises(KeyError, match=r"registered: .*'ToyArch'"):
        get_diffusion_model_cls("Nope")
    with pytest.raises(KeyError, match="architecture='Nope'"):
        get_diffusion_model_cls("Nope")


def test_duplicate_and_bad_registration(toy):
    class Other(_Toy):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_diffusion_model("ToyArch")(Other)
    register_diffusion_model("ToyArch")(toy)  # re-registering the same class is a no-op
    with pytest.raises(TypeError):
        register_diffusion_model("X")(nn.Linear)


def test_abstract_hooks_are_required():
    class Incomplete(DiffusionModelBase):
        def build_scheduler(self, config):
            return {"shift": 3.0}

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_builtin_sd3_adapter_is_registered_on_lookup():
    cls = get_diffusion_model_cls("SD3Transformer2DModel")
    assert cls.__name__ == "SD3FlowGRPO" and "SD3Transformer2DModel" in registered_diffusion_models()
