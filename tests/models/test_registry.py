"""The runtime registry comes from the specs' [model] tables alone, and a generated class never changes what
transformers itself reads from a model class (issue 11 item 10: `_ep_plan` belongs to transformers)."""

from __future__ import annotations

import pytest
import torch

from patchgen.config import load_config
from patchgen.spec_set import load_specs
from runtime.models.registry import REGISTRY, lookup
from runtime.models.tiny_configs import tiny_config

SPECS = {spec.name: spec for spec in load_specs(load_config(), None)}


def test_the_registry_is_exactly_the_specs_with_a_model_table() -> None:
    expected = {spec.model.model_type: name for name, spec in SPECS.items() if spec.model is not None}
    assert {m.model_type: m.spec for m in REGISTRY.values()} == expected
    for entry in REGISTRY.values():
        model = SPECS[entry.spec].model
        assert (entry.causal_lm, entry.upstream, entry.family, entry.capabilities) == (
            model.cls,
            model.upstream,
            model.family,
            model.capabilities,
        )
        assert entry.model_class().__module__ == entry.module


def test_unknown_model_type_says_how_to_add_one() -> None:
    with pytest.raises(ValueError, match=r"no generated model for model_type 'gpt9'.*\[model\] table"):
        lookup("gpt9")


TRANSFORMERS_MODELS = sorted(m.model_type for m in REGISTRY.values() if m.upstream.startswith("transformers."))


@pytest.mark.parametrize("model_type", TRANSFORMERS_MODELS)
def test_random_init_equals_upstream_and_transformers_ep_plan_is_untouched(model_type: str) -> None:
    """Same seed, same weights: transformers treats classes outside its package as custom code and may skip
    _init_weights for parameter-less modules (an MoE block); a spec that hits this needs core/native_weight_init."""
    entry = lookup(model_type)
    config = tiny_config(model_type)
    torch.manual_seed(0)
    upstream = entry.upstream_class().from_config(config)
    torch.manual_seed(0)
    generated = entry.model_class()(config)
    reference = upstream.state_dict()
    assert generated.state_dict().keys() == reference.keys()
    for name, value in generated.state_dict().items():
        assert torch.equal(value, reference[name]), name
    assert generated._ep_plan == upstream._ep_plan  # transformers' own expert-parallel plan, as upstream builds it
    # every MoE declares its EP plan, unless its spec states why EP does not fit (llama4_text: dense experts)
    assert hasattr(type(generated), "_patchgen_ep_plan") == (entry.is_moe and "ep" not in entry.supports.unsupported)
