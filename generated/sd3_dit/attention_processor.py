# ---- patchgen provenance (generated file: do not edit) ----
# Made by patchgen 0.1.0 from specs/sd3.toml; to change it, edit the spec or a
# template and run `patchgen regen sd3`. `patchgen check` fails when this file drifts.
# upstream: diffusers==0.40.0 diffusers/models/attention_processor.py sha256=7158a23bff0ce5bb1c03d66e2441dfd8d169b3598b2d494d32c6f88a3301ea01
# spec: specs/sd3.toml sha256=34fdad8151d34e7d9719d3dd47dea54ae566f2f02c7ea54f5f25a0a025f67947
# templates: sha256=07619aae329bd2deac45e8b9142992840a5b4b0e92239408827c47b7f5e7e7f1
# engine: patchgen==0.1.0 sha256=8b3dad80d0959425c1c2734f65165ba086134645d69df9c64250caebcf67a7b2
# body: sha256=debc05bb72f85777dcf8fa451b1467d45a1f34721391e396c67b59510ada0e3d
# patches:
#   #4 core/add_parameter @ JointAttnProcessor2_0.__call__: diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
#   #5 dit/ulysses_to_heads @ JointAttnProcessor2_0.__call__: joint attention over [image, text] in (b, h, s, d): image tokens all-to-all to this rank's heads, text (last) keeps this rank's heads; attn2 has no text
#   #6 dit/ulysses_to_sequence @ JointAttnProcessor2_0.__call__: and back: image tokens to this rank's slice, the text output gathered over heads
#   #7 dit/ring_attention @ JointAttnProcessor2_0.__call__: under a ring: ring attention over the image K/V, the text K/V attended once as extra K/V
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


class JointAttnProcessor2_0:
    """Attention processor used typically in processing the SD3-like self-attention projections."""

    def __init__(self):
        if not hasattr(F, "scaled_dot_product_attention"):
            raise ImportError("JointAttnProcessor2_0 requires PyTorch 2.0, to use it, please upgrade PyTorch to 2.0.")

    # patchgen #4 core/add_parameter (1 stmt): diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        *args,
        dit_sp=None,
        **kwargs,
    ) -> torch.FloatTensor:
        residual = hidden_states

        batch_size = hidden_states.shape[0]

        # `sample` projections.
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

        # `context` projections.
        if encoder_hidden_states is not None:
            encoder_hidden_states_query_proj = attn.add_q_proj(encoder_hidden_states)
            encoder_hidden_states_key_proj = attn.add_k_proj(encoder_hidden_states)
            encoder_hidden_states_value_proj = attn.add_v_proj(encoder_hidden_states)

            encoder_hidden_states_query_proj = encoder_hidden_states_query_proj.view(
                batch_size, -1, attn.heads, head_dim
            ).transpose(1, 2)
            encoder_hidden_states_key_proj = encoder_hidden_states_key_proj.view(
                batch_size, -1, attn.heads, head_dim
            ).transpose(1, 2)
            encoder_hidden_states_value_proj = encoder_hidden_states_value_proj.view(
                batch_size, -1, attn.heads, head_dim
            ).transpose(1, 2)

            if attn.norm_added_q is not None:
                encoder_hidden_states_query_proj = attn.norm_added_q(encoder_hidden_states_query_proj)
            if attn.norm_added_k is not None:
                encoder_hidden_states_key_proj = attn.norm_added_k(encoder_hidden_states_key_proj)

            query = torch.cat([query, encoder_hidden_states_query_proj], dim=2)
            key = torch.cat([key, encoder_hidden_states_key_proj], dim=2)
            value = torch.cat([value, encoder_hidden_states_value_proj], dim=2)
        # patchgen #5 dit/ulysses_to_heads (2 stmt): joint attention over [image, text] in (b, h, s, d): image tokens all-to-all to this rank's heads, text (last) keeps this rank's heads; attn2 has no text
        dit_attn = attention_split(dit_sp, replicated="last", dims="bhsd", site="specs/sd3.toml patch 5 (dit/ulysses_to_heads in JointAttnProcessor2_0.__call__)", module=attn)
        query, key, value, attention_mask = ulysses_to_heads(dit_attn, query, key, value, attention_mask)

        # patchgen #7 dit/ring_attention (1 stmt): under a ring: ring attention over the image K/V, the text K/V attended once as extra K/V
        hidden_states = ring_dispatch(dit_attn, F.scaled_dot_product_attention)(query, key, value, dropout_p=0.0, is_causal=False)
        # patchgen #6 dit/ulysses_to_sequence (1 stmt): and back: image tokens to this rank's slice, the text output gathered over heads
        hidden_states = ulysses_to_sequence(dit_attn, hidden_states)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            # Split the attention outputs.
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        else:
            return hidden_states
