# ---- patchgen provenance (generated file: do not edit) ----
# Made by patchgen 0.1.0 from specs/auraflow.toml; to change it, edit the spec or a
# template and run `patchgen regen auraflow`. `patchgen check` fails when this file drifts.
# upstream: diffusers==0.40.0 diffusers/models/attention_processor.py sha256=7158a23bff0ce5bb1c03d66e2441dfd8d169b3598b2d494d32c6f88a3301ea01
# spec: specs/auraflow.toml sha256=2092dfaa60df08a809b423a124721b788ec2757b773ead5d107b073395ef1c6c
# templates: sha256=ba26cf995502ec36607dfa6862742a839b587a02db2037156ccfc243213cbd4c
# engine: patchgen==0.1.0 sha256=8b3dad80d0959425c1c2734f65165ba086134645d69df9c64250caebcf67a7b2
# body: sha256=f7c281ad2287c57e0ec6bd95bda8f0f95444f39dc4945dd6376316f95cecd2b3
# patches:
#   #10 core/add_parameter @ AuraFlowAttnProcessor2_0.__call__: diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
#   #11 dit/ulysses_to_heads @ AuraFlowAttnProcessor2_0.__call__: attention over [text, image] in (b, h, s, d), joint or single block alike: image tokens all-to-all to this rank's heads, text (first) keeps this rank's heads; upstream passes no key mask
#   #12 dit/ulysses_to_sequence @ AuraFlowAttnProcessor2_0.__call__: and back: image tokens to this rank's slice, the text output gathered over heads
#   #13 dit/ring_attention @ AuraFlowAttnProcessor2_0.__call__: under a ring: ring attention over the image K/V, the text K/V attended once as extra K/V
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


class AuraFlowAttnProcessor2_0:
    """Attention processor used typically in processing Aura Flow."""

    def __init__(self):
        if not hasattr(F, "scaled_dot_product_attention") and is_torch_version("<", "2.1"):
            raise ImportError(
                "AuraFlowAttnProcessor2_0 requires PyTorch 2.0, to use it, please upgrade PyTorch to at least 2.1 or above as we use `scale` in `F.scaled_dot_product_attention()`. "
            )

    # patchgen #10 core/add_parameter (1 stmt): diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        *args,
        dit_sp=None,
        **kwargs,
    ) -> torch.FloatTensor:
        batch_size = hidden_states.shape[0]

        # `sample` projections.
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        # `context` projections.
        if encoder_hidden_states is not None:
            encoder_hidden_states_query_proj = attn.add_q_proj(encoder_hidden_states)
            encoder_hidden_states_key_proj = attn.add_k_proj(encoder_hidden_states)
            encoder_hidden_states_value_proj = attn.add_v_proj(encoder_hidden_states)

        # Reshape.
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)

        # Apply QK norm.
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # Concatenate the projections.
        if encoder_hidden_states is not None:
            encoder_hidden_states_query_proj = encoder_hidden_states_query_proj.view(
                batch_size, -1, attn.heads, head_dim
            )
            encoder_hidden_states_key_proj = encoder_hidden_states_key_proj.view(batch_size, -1, attn.heads, head_dim)
            encoder_hidden_states_value_proj = encoder_hidden_states_value_proj.view(
                batch_size, -1, attn.heads, head_dim
            )

            if attn.norm_added_q is not None:
                encoder_hidden_states_query_proj = attn.norm_added_q(encoder_hidden_states_query_proj)
            if attn.norm_added_k is not None:
                encoder_hidden_states_key_proj = attn.norm_added_k(encoder_hidden_states_key_proj)

            query = torch.cat([encoder_hidden_states_query_proj, query], dim=1)
            key = torch.cat([encoder_hidden_states_key_proj, key], dim=1)
            value = torch.cat([encoder_hidden_states_value_proj, value], dim=1)

        query = query.transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        # patchgen #11 dit/ulysses_to_heads (2 stmt): attention over [text, image] in (b, h, s, d), joint or single block alike: image tokens all-to-all to this rank's heads, text (first) keeps this rank's heads; upstream passes no key mask
        dit_attn = attention_split(dit_sp, replicated="first", dims="bhsd", site="specs/auraflow.toml patch 11 (dit/ulysses_to_heads in AuraFlowAttnProcessor2_0.__call__)", module=attn)
        query, key, value, _ = ulysses_to_heads(dit_attn, query, key, value)

        # Attention.
        # patchgen #13 dit/ring_attention (1 stmt): under a ring: ring attention over the image K/V, the text K/V attended once as extra K/V
        hidden_states = ring_dispatch(dit_attn, F.scaled_dot_product_attention)(
            query, key, value, dropout_p=0.0, scale=attn.scale, is_causal=False
        )
        # patchgen #12 dit/ulysses_to_sequence (1 stmt): and back: image tokens to this rank's slice, the text output gathered over heads
        hidden_states = ulysses_to_sequence(dit_attn, hidden_states)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        # Split the attention outputs.
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, encoder_hidden_states.shape[1] :],
                hidden_states[:, : encoder_hidden_states.shape[1]],
            )

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)
        if encoder_hidden_states is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        else:
            return hidden_states
