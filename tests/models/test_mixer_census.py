"""Every sequence mixer of every generated language model is covered by a sequence-parallel patch.

The runtime's per-forward site check watches the modules it is told are attention; this census does not trust
names. It runs each generated causal LM on its tiny config and on each tiny variant (the config-gated branches),
finds the modules that mix information across the sequence by perturbing one token (``runtime/parallel/mixers.py``),
and requires each minimal mixer to be the scope of one of its spec's ``sp/`` or ``dit/`` patches, for every model
whose record claims sp. A mixer nobody patched (a linear-attention layer, a causal convolution, a recurrence beside
the patched attention) would attend to one rank's tokens under SP and train wrong numbers silently; here it fails,
naming the module, its class and the spec.
"""

from __future__ import annotations

import functools

import pytest
import torch

from patchgen.config import load_config
from patchgen.spec_set import load_specs
from runtime.models.registry import causal_lm_class, lookup, model_types, variant_cases, variant_overrides
from runtime.models.tiny_configs import tiny_config
from runtime.parallel.mixers import minimal_mixers, mixing_modules
from tests.engine.helpers import REPO

LENGTH = 24  # past every tiny sliding window, so a windowed layer mixes as it does in training
SP_FAMILIES = ("sp/", "dit/")  # the patch kinds that give a module a sequence-parallel path


@functools.cache
def patched_scopes() -> dict[str, frozenset[str]]:
    """model_type -> the scopes of its spec's sequence-parallel patches (``Class.method``)."""
    scopes = {}
    for spec in load_specs(load_config(REPO), None):
        if spec.model is not None:
            own = {p.scope for p in spec.patches if p.template.name.startswith(SP_FAMILIES)}
            scopes[spec.model.model_type] = frozenset(own)
    return scopes


def covering_classes(name: str, module: torch.nn.Module, model: torch.nn.Module) -> set[str]:
    """The generated classes a patch covering ``module`` may be on: its own, its attention processor's, and, for a
    torch layer (a ``Conv2d``: no code of the model's to patch), its parent's, whose forward calls it. Only classes
    of the generated modules count: upstream's class of the same name (a processor set back to diffusers' own) was
    never patched."""
    found = [module, getattr(module, "processor", None)]
    if type(module).__module__.startswith("torch.") and "." in name:
        found.append(model.get_submodule(name.rpartition(".")[0]))
    return {type(x).__name__ for x in found if x is not None and type(x).__module__.startswith("generated.")}


def uncovered(model_type: str, mixers: dict[str, torch.nn.Module], model: torch.nn.Module) -> list[str]:
    classes = {scope.split(".")[0] for scope in patched_scopes()[model_type]}
    return [
        f"{name} ({type(module).__name__})"
        for name, module in mixers.items()
        if not covering_classes(name, module, model) & classes
    ]


CASES = [case for case in variant_cases(model_types("causal_lm")) if lookup(case[0]).supports.sp]


@pytest.mark.parametrize("model_type, variant", CASES, ids=[f"{m}-{v or 'tiny'}" for m, v in CASES])
def test_every_mixer_of_a_causal_lm_has_an_sp_patch(model_type: str, variant: str | None) -> None:
    torch.manual_seed(0)
    model = causal_lm_class(model_type)(tiny_config(model_type, **variant_overrides(model_type, variant))).eval()
    ids = torch.randint(1, model.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    mixers = minimal_mixers(mixing_modules(model, lambda: model(input_ids=ids), LENGTH))
    assert mixers, f"{model_type}: no module mixes the sequence: the census saw nothing (its proof has no power)"
    missing = uncovered(model_type, mixers, model)
    assert not missing, (
        f"{model_type}: sequence mixers without an sp/ or dit/ patch in specs/{model_type}.toml (under SP they would "
        f"see one rank's tokens): {', '.join(missing)}"
    )


class _RunningMean(torch.nn.Module):
    """A per-token MLP followed by a causal running mean over the sequence: a mixer no class name announces (as a
    gated delta-net or a short causal convolution beside attention)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.mlp(hidden_states)
        steps = torch.arange(1, out.shape[1] + 1, dtype=out.dtype).view(1, -1, 1)
        return out.cumsum(dim=1) / steps


def test_the_census_finds_a_mixer_that_no_name_announces() -> None:
    """Its power: the same census on qwen3 with layer 0's MLP turned into a causal running mean names that MLP
    (and still finds both attention modules, which qwen3's spec covers)."""
    torch.manual_seed(0)
    model = causal_lm_class("qwen3")(tiny_config("qwen3")).eval()
    model.model.layers[0].mlp = _RunningMean(model.model.layers[0].mlp)
    ids = torch.randint(1, model.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    mixers = minimal_mixers(mixing_modules(model, lambda: model(input_ids=ids), LENGTH))
    assert sorted(mixers) == ["model.layers.0.mlp", "model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert uncovered("qwen3", mixers, model) == ["model.layers.0.mlp (_RunningMean)"]


def _dit_cases() -> list:
    from runtime.diffusion.registry import lookup_dit
    from tests.dit.cases import CASES as DIT_CASES

    return [case for case in DIT_CASES.values() if lookup_dit(case.model_type).supports.sp]


@pytest.mark.parametrize("case", _dit_cases(), ids=lambda case: case.name)
def test_every_mixer_of_a_dit_has_an_sp_patch(case) -> None:
    """The same census on each DiT's training class (tiny config and variants), on every token stream (image, text,
    joint: each (batch, n, width) argument); the modules the spec runs before the token split on replicated tokens
    (``replicated_modules``) need no SP path."""
    from runtime.diffusion.registry import lookup_dit
    from tests.dit.cases import inputs, shell

    model, kwargs = shell(case).eval(), inputs(case)
    run = lambda: model(**kwargs)  # noqa: E731
    replicated = lookup_dit(case.model_type).supports.replicated_modules
    mixers = {
        name: module
        for name, module in minimal_mixers(mixing_modules(model, run)).items()
        if not any(name == path or name.startswith(f"{path}.") for path in replicated)
    }
    assert mixers, f"{case.name}: no module mixes its tokens: the census saw nothing (no power)"
    missing = uncovered(case.model_type, mixers, model)
    assert not missing, (
        f"{case.name}: sequence mixers without an sp/ or dit/ patch in its spec (under SP they would see one rank's "
        f"tokens): {', '.join(missing)}"
    )


def test_the_census_finds_a_processor_set_back_to_upstreams() -> None:
    """Its power on a DiT: flux with one block's processor replaced by diffusers' own ``FluxAttnProcessor`` (same
    class name, never patched) is named uncovered."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from tests.dit.cases import CASES as DIT_CASES
    from tests.dit.cases import inputs, shell

    model, kwargs = shell(DIT_CASES["flux"]).eval(), inputs(DIT_CASES["flux"])
    model.transformer_blocks[0].attn.set_processor(FluxAttnProcessor())
    mixers = minimal_mixers(mixing_modules(model, lambda: model(**kwargs)))
    assert uncovered("flux", mixers, model) == ["transformer_blocks.0.attn (FluxAttention)"]


VLM_CASES = [case for case in variant_cases(model_types("vlm")) if lookup(case[0]).supports.sp]


@pytest.mark.parametrize("model_type, variant", VLM_CASES, ids=[f"{m}-{v or 'tiny'}" for m, v in VLM_CASES])
def test_every_mixer_of_a_vlm_has_an_sp_patch(model_type: str, variant: str | None) -> None:
    """The census on each vision-language model with two images in its row: the language model's token stream and
    the vision tower's packed patches (rows without a batch dimension) alike."""
    from tests.parity.vlm import vlm_batch

    config = tiny_config(model_type, **variant_overrides(model_type, variant))
    torch.manual_seed(0)
    model = lookup(model_type).causal_lm_class()(config).eval()
    batch = vlm_batch(model_type)
    mixers = minimal_mixers(mixing_modules(model, lambda: model(**batch)))
    assert mixers, f"{model_type}: no module mixes the sequence: the census saw nothing (its proof has no power)"
    missing = uncovered(model_type, mixers, model)
    assert not missing, (
        f"{model_type}: sequence mixers without an sp/ or dit/ patch in specs/{model_type}.toml (under SP they would "
        f"see one rank's tokens): {', '.join(missing)}"
    )


def test_every_mixer_of_the_omni_thinker_has_an_sp_patch() -> None:
    """The census on the omni thinker with an image, an audio clip and a video with audio in its row: its language
    model, vision tower and audio encoder (its convolution front end runs on the whole gathered sequence)."""
    from tests.omni.omni import MODEL_TYPE, generated_class, omni_batch, tiny_omni_config
    from tests.omni.test_omni_off import ROWS

    torch.manual_seed(0)
    model = generated_class()(tiny_omni_config()).eval()
    batch = omni_batch(*ROWS["image+audio+video_with_audio"])
    mixers = minimal_mixers(mixing_modules(model, lambda: model(**batch)))
    assert mixers, f"{MODEL_TYPE}: no module mixes the sequence: the census saw nothing (its proof has no power)"
    assert not uncovered(MODEL_TYPE, mixers, model), uncovered(MODEL_TYPE, mixers, model)
