"""The training runtime. Importing it drops one by-design notice of transformers (``runtime/pil_fallback.py``)."""

from runtime import pil_fallback

pil_fallback.install()
