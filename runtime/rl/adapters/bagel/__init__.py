"""A BAGEL-style mixture-of-transformers (MoT) denoiser and its RL adapter ``"BagelMoT"``.

The package, one responsibility a module:

* ``model.py``: ``BagelMoT`` (a ``NonDiffusersModelBase``), a small Qwen2-like decoder whose every layer has an
  "understanding" pathway for text and special tokens and a "generation" pathway (``_moe_gen``) for latent tokens,
  all tokens attending jointly; its sequence layout, RoPE positions and dtype conventions are in its docstring;
* ``checkpoint.py``: BAGEL's ``ema.safetensors`` names mapped to ours (``BAGEL_KEY_MAP``, the ViT tower skipped),
  ``load_bagel_checkpoint`` / ``save_bagel_checkpoint``, and BAGEL's special tokens and prompt layout;
* ``adapter.py``: ``BagelMoTFlowGRPO``, the sampler as BAGEL's own (its shifted ``linspace(1, 0, N + 1)``
  schedule, its 3-branch CFG run as one batch, ``bagel_guidance``'s combination, renormalisation and interval
  gating); importing it registers the adapter;
* ``tiny_checkpoint.py``: ``save_tiny_bagel``, a tiny random checkpoint directory for tests, demos and the docs.
"""

from __future__ import annotations

from runtime.rl.adapters.bagel.adapter import BagelMoTFlowGRPO, bagel_guidance, bagel_sigmas
from runtime.rl.adapters.bagel.checkpoint import (
    BAGEL_IGNORED_PREFIXES,
    BAGEL_KEY_MAP,
    BAGEL_SPECIAL_TOKENS,
    BAGEL_WEIGHTS_NAME,
    bagel_new_token_ids,
    bagel_prompt_ids,
    from_bagel_keys,
    load_bagel_checkpoint,
    save_bagel_checkpoint,
    to_bagel_keys,
)
from runtime.rl.adapters.bagel.model import BagelMoT
from runtime.rl.adapters.bagel.tiny_checkpoint import save_tiny_bagel

__all__ = [
    "BagelMoT",
    "BagelMoTFlowGRPO",
    "BAGEL_KEY_MAP",
    "BAGEL_IGNORED_PREFIXES",
    "BAGEL_SPECIAL_TOKENS",
    "BAGEL_WEIGHTS_NAME",
    "bagel_new_token_ids",
    "bagel_prompt_ids",
    "bagel_guidance",
    "bagel_sigmas",
    "from_bagel_keys",
    "to_bagel_keys",
    "load_bagel_checkpoint",
    "save_bagel_checkpoint",
    "save_tiny_bagel",
]
