"""Drop transformers' notice that an image processor fell back to its PIL class because torchvision is missing.

transformers 5 resolves ``transformers.CLIPImageProcessor`` (and every ``<Model>ImageProcessor``) to the torchvision
class, and without torchvision to ``<Model>ImageProcessorPil``, logging once per class that it did. diffusers'
pipeline modules import ``CLIPImageProcessor`` and ``SiglipImageProcessor`` at import time (``pipeline_flux.py``,
``loaders/ip_adapter.py``), so every DiT run printed two such lines per process although no image processor is
used. The PIL class is what the runtime selects anyway (``runtime/data/vision/processor.py``): torchvision is not
installed here because PyPI's torchvision 0.28.0 for torch 2.13.0 is a CUDA build that does not import beside the CPU
torch (``operator torchvision::nms does not exist``). Only that exact notice is dropped; every other transformers
message is kept.
"""

from __future__ import annotations

import logging
import re

# transformers/utils/import_utils.py, _LazyModule.__getattr__ (transformers 5.14.1)
_NOTICE = re.compile(
    r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil`"
)
_LOGGER = "transformers.utils.import_utils"


class _DropPilFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _NOTICE.match(record.getMessage())


def install() -> None:
    """Add the filter to the logger transformers logs the notice on (idempotent; needs no transformers import)."""
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, _DropPilFallbackNotice) for f in logger.filters):
        logger.addFilter(_DropPilFallbackNotice())
