"""Let generated classes load and save checkpoints exactly like their upstream classes.

transformers converts some checkpoint layouts on load (legacy key names such as Qwen2.5-VL's `model.layers.*` /
`visual.*`, per-expert MoE weights -> stacked 3-D tensors) and reverts the conversion on save, but it skips both for
classes defined outside the `transformers` package unless their class name or `model_type` was registered by the
user. A generated module has upstream's class names, parameters and layout, so when it is imported it registers
upstream's conversions for its `model_type` and for each of its classes that upstream keys a mapping by name.
"""

from __future__ import annotations

import sys

from transformers.conversion_mapping import (
    USER_REGISTERED_MAPPINGS,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)


def share_upstream_weight_conversions(model_type: str, module_name: str | None = None) -> list[str]:
    """Idempotent: mark `model_type`'s conversions, and those keyed by the name of a class defined in the module
    `module_name`, as usable by non-transformers classes. Returns the names registered (for tests)."""
    names = [model_type]
    if module_name is not None:
        module = sys.modules[module_name]
        names += sorted(
            name for name, value in vars(module).items() if isinstance(value, type) and value.__module__ == module_name
        )
    shared = []
    for name in names:
        if name in USER_REGISTERED_MAPPINGS:
            shared.append(name)
            continue
        mapping = get_checkpoint_conversion_mapping(name)
        if mapping is not None:
            register_checkpoint_conversion_mapping(name, mapping, overwrite=True)
            shared.append(name)
    return shared
