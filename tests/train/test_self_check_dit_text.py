"""The DiT self-check line names the shrunk transformer's real sizes for every DiT spec, whatever its config calls
them (Lumina2 has ``hidden_size`` and no ``attention_head_dim``; Flux, HunyuanVideo and AuraFlow count their blocks
under several keys): the heads and head width its attention modules actually have, never "None" or "?"."""

from __future__ import annotations

import re

import pytest
import torch

from runtime.diffusion.registry import dit_model_types, lookup_dit, tiny_config
from runtime.parallel.state import ParallelState
from runtime.train.self_check_dit import shrunk_dit_text, shrunk_dit_values


def _attention_sizes(model: torch.nn.Module) -> set[tuple[int, int]]:
    """(heads, head width) of every self-attention the model built (diffusers' ``Attention``-like modules)."""
    found = set()
    for module in model.modules():
        heads, to_q = getattr(module, "heads", None), getattr(module, "to_q", None)
        if isinstance(heads, int) and isinstance(to_q, torch.nn.Linear):
            found.add((heads, to_q.out_features // heads))
    return found


@pytest.mark.parametrize("model_type", dit_model_types())
def test_the_line_names_the_real_heads_and_width(model_type: str) -> None:
    values = shrunk_dit_values(model_type, tiny_config(model_type), ParallelState())
    model_class = lookup_dit(model_type).model_class()
    torch.manual_seed(0)
    model = model_class(model_class.config_class(**values))
    text = shrunk_dit_text(model, values)
    match = re.fullmatch(r"(\d+) blocks, (\d+) heads of (\d+)", text)
    assert match, text
    blocks, heads, width = (int(g) for g in match.groups())
    assert blocks >= 1
    assert (heads, width) in _attention_sizes(model), (text, _attention_sizes(model))
