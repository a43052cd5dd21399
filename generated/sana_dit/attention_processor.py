# ---- patchgen provenance (generated file: do not edit) ----
# Made by patchgen 0.1.0 from specs/sana.toml; to change it, edit the spec or a
# template and run `patchgen regen sana`. `patchgen check` fails when this file drifts.
# upstream: diffusers==0.40.0 diffusers/models/attention_processor.py sha256=7158a23bff0ce5bb1c03d66e2441dfd8d169b3598b2d494d32c6f88a3301ea01
# spec: specs/sana.toml sha256=2aebf8e7e563622689d3823807fc325e5201cb05ea7da9b214e09ce74a60e96b
# templates: sha256=28d35bc548a5fe106e4110df01257b6f9564be9294fe23cc932f50e384ec762e
# engine: patchgen==0.1.0 sha256=8b3dad80d0959425c1c2734f65165ba086134645d69df9c64250caebcf67a7b2
# body: sha256=735fb285cd7be0afdc22d49482260189311fe93d5c95d2ced035df49ec988429
# patches:
#   #12 core/add_parameter @ SanaLinearAttnProcessor2_0.__call__: diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
#   #13 dit/linear_attention_kv @ SanaLinearAttnProcessor2_0.__call__: the key-value sums over every token of the SP group: one all-reduce, exact
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
# patchgen imports (1 stmt): names the patches below use
from runtime.diffusion.sp_grid import sp_linear_kv


class SanaLinearAttnProcessor2_0:
    r"""
    Processor for implementing scaled dot-product linear attention.
    """

    # patchgen #12 core/add_parameter (1 stmt): diffusers' Attention passes a processor only the kwargs its signature names: the processor takes the split
    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        dit_sp=None,
    ) -> torch.Tensor:
        original_dtype = hidden_states.dtype

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        query = query.transpose(1, 2).unflatten(1, (attn.heads, -1))
        key = key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)
        value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))

        query = F.relu(query)
        key = F.relu(key)

        query, key, value = query.float(), key.float(), value.float()

        value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)
        # patchgen #13 dit/linear_attention_kv (1 stmt): the key-value sums over every token of the SP group: one all-reduce, exact
        scores = sp_linear_kv(value, key, dit_sp, attn)
        hidden_states = torch.matmul(scores, query)

        hidden_states = hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + 1e-15)
        hidden_states = hidden_states.flatten(1, 2).transpose(1, 2)
        hidden_states = hidden_states.to(original_dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        if original_dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        return hidden_states
