# ---- patchgen provenance (generated file: do not edit) ----
# Made by patchgen 0.1.0 from specs/cogvideox.toml; to change it, edit the spec or a
# template and run `patchgen regen cogvideox`. `patchgen check` fails when this file drifts.
# upstream: diffusers==0.40.0 diffusers/models/attention_processor.py sha256=7158a23bff0ce5bb1c03d66e2441dfd8d169b3598b2d494d32c6f88a3301ea01
# spec: specs/cogvideox.toml sha256=8d71ee30a8854aa55f22bfbf8b1dd26e1263a6f16313faa95fc6feb08ce83c6a
# templates: sha256=740e7fd8b4b7ae7b9002ecb62d96eb835214f1785bc9f915a0c730ad18ed8086
# engine: patchgen==0.1.0 sha256=8b3dad80d0959425c1c2734f65165ba086134645d69df9c64250caebcf67a7b2
# body: sha256=aea3a1cfe0fbe132a38c21076a42a04678cd30d53a40a3ab5e6a061d6d461ebe
# patches:
#   #4 core/add_parameter @ CogVideoXAttnProcessor2_0.__call__: diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
#   #5 dit/ulysses_to_heads @ CogVideoXAttnProcessor2_0.__call__: joint attention over [text, video] in (b, h, s, d): video tokens all-to-all to this rank's heads, text (first) keeps this rank's heads
#   #6 dit/ulysses_to_sequence @ CogVideoXAttnProcessor2_0.__call__: and back: video tokens to this rank's slice, the text output gathered over heads
#   #7 dit/ring_attention @ CogVideoXAttnProcessor2_0.__call__: under a ring: ring attention over the video K/V, the text K/V attended once as extra K/V
# ---- end of patchgen provenance ----
# Copyright 2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.utils import deprecate, is_torch_xla_available, logging
from diffusers.utils.import_utils import is_torch_npu_available, is_torch_xla_version, is_xformers_available
from diffusers.utils.torch_utils import is_torch_version, maybe_allow_in_graph
# patchgen companion (1 stmt): upstream definitions this module does not redefine
from diffusers.models.attention_processor import Attention
# patchgen imports (3 stmt): names the patches below use
from runtime.diffusion.sp import attention_split, ulysses_to_heads
from runtime.diffusion.sp import ulysses_to_sequence
from runtime.diffusion.sp_ring import ring_dispatch


class CogVideoXAttnProcessor2_0:
    r"""
    Processor for implementing scaled dot-product attention for the CogVideoX model. It applies a rotary embedding on
    query and key vectors, but does not include spatial normalization.
    """

    def __init__(self):
        if not hasattr(F, "scaled_dot_product_attention"):
            raise ImportError("CogVideoXAttnProcessor requires PyTorch 2.0, to use it, please upgrade PyTorch to 2.0.")

    # patchgen #4 core/add_parameter (1 stmt): diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        dit_sp=None,
    ) -> torch.Tensor:
        text_seq_length = encoder_hidden_states.size(1)

        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        batch_size, sequence_length, _ = hidden_states.shape

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # Apply RoPE if needed
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)
        # patchgen #5 dit/ulysses_to_heads (2 stmt): joint attention over [text, video] in (b, h, s, d): video tokens all-to-all to this rank's heads, text (first) keeps this rank's heads
        dit_attn = attention_split(dit_sp, replicated="first", dims="bhsd", site="specs/cogvideox.toml patch 5 (dit/ulysses_to_heads in CogVideoXAttnProcessor2_0.__call__)", module=attn)
        query, key, value, attention_mask = ulysses_to_heads(dit_attn, query, key, value, attention_mask)

        # patchgen #7 dit/ring_attention (1 stmt): under a ring: ring attention over the video K/V, the text K/V attended once as extra K/V
        hidden_states = ring_dispatch(dit_attn, F.scaled_dot_product_attention)(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        # patchgen #6 dit/ulysses_to_sequence (1 stmt): and back: video tokens to this rank's slice, the text output gathered over heads
        hidden_states = ulysses_to_sequence(dit_attn, hidden_states)

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
        )
        return hidden_states, encoder_hidden_states
