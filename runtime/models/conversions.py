"""Let generated classes load and save checkpoints exactly like their upstream classes.

transformers converts some checkpoint layouts on load (e.g. per-expert MoE weights -> stacked 3-D tensors) and
reverts the conversion on save, but it skips both for classes defined outside the `transformers` package. A
generated module has upstream's parameters and layout, so it opts in to upstream's conversions for its
`model_type` when it is imported.
"""

from __future__ import annotations

from transformers.conversion_mapping import (
    USER_REGISTERED_MAPPINGS,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)


def share_upstream_weight_conversions(model_type: str) -> None:
    """Idempotent: mark `model_type`'s built-in conversions as usable by non-transformers classes."""
    if model_type in USER_REGISTERED_MAPPINGS:
        return
    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping is not None:
        register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)
