"""Opening an image file with PIL where the runtime reads images (training data, DPO pairs): PIL's
decompression-bomb guard as one error naming the file, never a warning.

PIL refuses an image of more than twice ``PIL.Image.MAX_IMAGE_PIXELS`` (about 179 M pixels) with
``DecompressionBombError``, whose message names no file, and for one between the limit and twice it prints a
``DecompressionBombWarning`` to stderr and goes on decoding. Neither is a training sample (every image is resized to
a bucket of at most 16384 pixels a side), so both are ``ImageTooLarge`` here: a ``ValueError`` the readers turn into
their one-line ``file:line`` errors.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["ImageTooLarge", "open_image"]


class ImageTooLarge(ValueError):
    """An image over PIL's decompression-bomb limit."""


@contextmanager
def open_image(path: str | Path) -> Iterator[Any]:
    """``PIL.Image.open(path)`` (closed on exit), ``ImageTooLarge`` for an image over PIL's pixel limit; PIL's own
    errors for a broken file pass through."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageTooLarge(
            f"{path}: {_pixels(exc)} more than PIL's limit of {Image.MAX_IMAGE_PIXELS} pixels (a guard against "
            f"decompression bombs); give a smaller image"
        ) from None
    with image:
        yield image


def _pixels(exc: Exception) -> str:
    """'N pixels,' from PIL's message ("Image size (N pixels) exceeds limit of ..."), or nothing."""
    text = str(exc)
    start = text.find("(")
    end = text.find(" pixels)", start)
    return f"{text[start + 1 : end]} pixels," if 0 <= start < end else "an image of"
