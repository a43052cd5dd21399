"""Ulysses SP inside a chunked Whisper-style audio encoder.

Such an encoder (Qwen3-Omni, Qwen2.5-Omni) cuts each audio's mel frames into fixed windows, runs a convolutional
front end on every window (the windows padded to one length), keeps the valid post-convolution frames of all audios
as one flat sequence ``(T, d)`` and then runs transformer layers whose attention is split into segments by
``cu_seqlens`` (varlen attention; a segment never spans two audios).

Every SP rank receives the whole sample's mel features (as it receives the whole pixel values), so the front end
runs on the full sequence on every rank and nothing has to be gathered before it. After it:

1. ``audio_sp_slice``: pad the flat sequence to a multiple of sp, keep this rank's contiguous slice, and append the
   padding as its own ``cu_seqlens`` segment, so no real frame attends to it;
2. the attention layers exchange q/k/v with the Ulysses all-to-all (``runtime.sp.vision.vit_all_to_all``: all
   frames x this rank's heads), attend per segment, and exchange back;
3. ``audio_sp_gather``: after the last layer, all-gather the slices and drop the padding, so the encoder's
   post-processing (norm, pooling, projection) and its output are upstream's, on the full sequence.

The LM side then keeps the audio tokens of its own slice of the text sequence (``runtime.sp.vision``'s
``local_visual_tokens``, which is modality-agnostic). Every hook is the identity when SP is off.

Gradients follow ``runtime.parallel.collectives``' partial-gradient convention: the front end's weights get, on each
rank, the gradient of that rank's slice only; summed over the SP group that is the full gradient.
"""

from __future__ import annotations

from torch import Tensor

from runtime.parallel.state import get_parallel_state
from runtime.sp.vision import vit_gather, vit_pad_and_slice, vit_pad_cu_seqlens

__all__ = ["audio_sp_gather", "audio_sp_slice"]


def audio_sp_slice(hidden_states: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(this rank's slice of the padded frames, cu_seqlens with the padding segment, padding length)``.

    ``hidden_states`` is the encoder's flat post-convolution sequence ``(T, d)``. Returns the inputs and 0 when SP
    is off.
    """
    state = get_parallel_state()
    if not state.sp_enabled:
        return hidden_states, cu_seqlens, 0
    pad = -hidden_states.shape[0] % state.sp_size
    return vit_pad_and_slice(hidden_states, pad), vit_pad_cu_seqlens(cu_seqlens, pad), pad


def audio_sp_gather(hidden_states: Tensor, pad: int) -> Tensor:
    """The full ``(T, d)`` sequence from every rank's slice, padding dropped; ``hidden_states`` when SP is off."""
    return vit_gather(hidden_states, pad)
