"""Load a sub-model from the checkpoint of the model that contains it, dropping the other parts' weights loudly.

A Qwen3-Omni checkpoint holds the thinker (``thinker.*``), the talker (``talker.*``) and code2wav (``code2wav.*``).
The generated thinker class is what trains; transformers strips the ``thinker.`` prefix (the class's
``base_model_prefix``) and reports everything else as unexpected keys in a table that is easy to miss. The generated
class (template ``core/submodel_checkpoint``) instead drops the keys of the parts it declares, logs one line
with their number, and refuses any other unexpected key: a key the thinker should have had is an error, not a
warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["drop_checkpoint_prefixes"]

logger = logging.getLogger(__name__)


def drop_checkpoint_prefixes(loading_info: Any, prefixes: Sequence[str], model_name: str) -> int:
    """Remove the unexpected keys under ``prefixes`` from ``loading_info`` (transformers' ``LoadStateDictInfo``),
    log their number and return it; ValueError naming the keys if any other unexpected key remains.

    Keys are counted as transformers names them after its layout conversions (e.g. a talker's per-expert weights
    count once per stacked tensor), i.e. as the full model's ``state_dict`` names them.
    """
    unexpected = set(loading_info.unexpected_keys)
    dropped = {key for key in unexpected if key.startswith(tuple(prefixes))}
    others = sorted(unexpected - dropped)
    if others:
        shown = ", ".join(others[:5]) + (f" (+{len(others) - 5} more)" if len(others) > 5 else "")
        raise ValueError(
            f"{model_name}: the checkpoint has {len(others)} weight(s) this model does not have: {shown}; only "
            f"{', '.join(p + '*' for p in prefixes)} are dropped (the parts of the full model this class leaves out)"
        )
    loading_info.unexpected_keys = set()
    if dropped:
        logger.warning(
            "%s: dropped %d weights of %s (parts of the full model this class leaves out)",
            model_name,
            len(dropped),
            ", ".join(p + "*" for p in prefixes),
        )
    return len(dropped)
