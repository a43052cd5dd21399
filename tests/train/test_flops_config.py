"""The trainer's FLOPs count reads what each MoE config has: the expert count and expert size under the names its
family uses (qwen3_moe's num_experts / moe_intermediate_size, gpt_oss's num_local_experts / intermediate_size,
deepseek-style n_routed_experts, shared experts and leading dense layers); no model crashes it before step 1."""

from __future__ import annotations

import pytest
import transformers

from runtime.models.registry import model_types
from runtime.models.tiny_configs import tiny_config
from runtime.train.metrics import _matmul_params, causal_lm_flops


@pytest.mark.parametrize("model_type", model_types("causal_lm"))
def test_every_causal_lm_has_a_flops_count(model_type: str) -> None:
    assert causal_lm_flops(tiny_config(model_type), [5, 7]) > 0


def test_gpt_oss_counts_its_experts() -> None:
    config = tiny_config("gpt_oss")
    h, layers = config.hidden_size, config.num_hidden_layers
    attn = h * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * h * config.intermediate_size * config.num_experts_per_tok + h * config.num_local_experts
    assert _matmul_params(config) == layers * (attn + mlp) + h * config.vocab_size


def test_routed_shared_and_dense_layers() -> None:
    """A deepseek-v3-shaped config (sigmoid router without a load-balancing loss): 1 dense layer, then routed +
    shared experts."""
    config = transformers.DeepseekV3Config(
        vocab_size=100,
        hidden_size=8,
        intermediate_size=20,
        moe_intermediate_size=4,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=6,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        head_dim=4,
    )
    attn = 8 * 4 * (2 * 2 + 2 * 2)
    sparse = 3 * 8 * (4 * 2 + 4) + 8 * 6
    dense = 3 * 8 * 20
    assert _matmul_params(config) == 3 * attn + dense + 2 * sparse + 8 * 100
