"""Load a sub-model from the checkpoint of the model that contains it, dropping the other parts' weights loudly.

A Qwen3-Omni checkpoint holds the thinker (``thinker.*``), the talker (``talker.*``) and code2wav (``code2wav.*``).
The generated thinker loads it exactly as upstream does: transformers strips the ``thinker.`` prefix (the class's
``base_model_prefix``) and reports everything else in ``loading_info`` as unexpected keys, in a table that is easy
to miss. A generated class must accept what upstream accepts, so the strictness lives here, in our trainer's loader:
the spec declares the parts the class leaves out (template ``core/submodel_checkpoint`` writes them as the class
attribute ``_patchgen_parts_left_out``); their keys are dropped with one log line giving their number, and any other
unexpected key stays an error of the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

__all__ = ["drop_parts_left_out"]

logger = logging.getLogger(__name__)


def drop_parts_left_out(model_class: type, unexpected_keys: Iterable[str]) -> list[str]:
    """The unexpected keys that remain once the keys of the parts ``model_class`` declares as left out are dropped;
    the dropped ones are counted in one warning.

    Keys are counted as transformers names them after its layout conversions (e.g. a talker's per-expert weights
    count once per stacked tensor), i.e. as the full model's ``state_dict`` names them.
    """
    prefixes = tuple(getattr(model_class, "_patchgen_parts_left_out", ()))
    unexpected = sorted(unexpected_keys)
    if not prefixes:
        return unexpected
    dropped = [key for key in unexpected if key.startswith(prefixes)]
    if dropped:
        logger.warning(
            "%s: dropped %d weights of %s (parts of the full model this class leaves out)",
            model_class.__name__,
            len(dropped),
            ", ".join(p + "*" for p in prefixes),
        )
    return [key for key in unexpected if not key.startswith(prefixes)]
