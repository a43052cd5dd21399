"""The M-RoPE position-id function the data pipeline calls per sample, without building the model.

Qwen-VL models compute multimodal RoPE ids (T, H, W per token) in ``Model.get_rope_index`` from the token ids, the
token types and the image/video grids. Under SP they must be computed on the whole sample before the sequence is
sliced, i.e. in the data pipeline, and packing needs them per sample (each packed sample restarts at 0). The
generated ``*ForConditionalGeneration.get_position_id_func(config)`` returns a ``RopeIndexFunction``: upstream's own
``get_rope_index`` bound to a weightless stand-in that carries only the config, so it runs in a data worker (it
pickles: a class reference and a config) and gives exactly the model's ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["RopeIndexFunction"]


class _ConfigOnly:
    """Stands in for ``self`` in a model method that reads only ``self.config`` and other such methods."""

    def __init__(self, model_cls: type, config: Any) -> None:
        self.config = config
        self._model_cls = model_cls

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_model_cls":
            raise AttributeError(name)
        return getattr(self._model_cls, name).__get__(self)


@dataclass(frozen=True)
class RopeIndexFunction:
    """``fn(input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None, **extra) -> (3, bs, L)``:
    the first value of ``model_cls.get_rope_index`` for a model with ``config``. ``extra`` passes model-specific
    inputs through (qwen2_5_vl's ``second_per_grid_ts``)."""

    model_cls: type
    config: Any

    def __call__(
        self,
        input_ids: Tensor,
        mm_token_type_ids: Tensor,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        **extra: Any,
    ) -> Tensor:
        host = _ConfigOnly(self.model_cls, self.config)
        position_ids, _ = self.model_cls.get_rope_index(
            host, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, **extra
        )
        return position_ids
