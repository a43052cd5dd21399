"""Ovis-Image condition model: a Qwen3 text encoder (the prompt in a chat template behind a system prompt, the
template's first 28 tokens dropped) and Flux's AutoencoderKL, loaded from an ``OvisImagePipeline`` directory.

Everything but the text side is Flux's (``runtime/diffusion/conditions/flux.py``): latents ``(z - shift_factor) *
scaling_factor`` packed 2x2 into tokens, logit-normal noise levels shifted by the resolution's ``mu``, the timestep
sigma (the pipeline passes ``t / 1000``). The transformer takes no pooled projection and no guidance embedding; its
text positions are ``(0, i, i)`` per text token (``OvisImagePipeline._prepare_prompt_embeds``), and the pipeline
guides with true CFG (a negative prompt, ``guidance_scale`` 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import OvisImagePipeline
from torch import Tensor

from runtime.diffusion.conditions.base import stack_context
from runtime.diffusion.conditions.flux import FluxConditionModel

__all__ = ["OvisImageConditionModel"]

TEXT_LENGTH = 256  # OvisImagePipeline's max_sequence_length (text tokens after the template's first 28)

# Qwen3's chat template, the part the pipeline's one user message without thinking renders
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


class OvisImageConditionModel(FluxConditionModel):
    pipeline_class = OvisImagePipeline
    components = ("tokenizer", "text_encoder", "vae")
    pipeline_call = {"guidance_scale": 5.0}

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from transformers import Qwen3Config, Qwen3Model

        from runtime.diffusion.tiny_pipelines import tiny_tokenizer

        flux = FluxConditionModel.tiny_components({**config, "pooled_projection_dim": 16}, variant)
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        text_encoder = Qwen3Model(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=config["joint_attention_dim"],
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=TEXT_LENGTH + 64,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=flux["vae"], scheduler=flux["scheduler"])

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        prompt_embeds, _, _, _ = self.pipeline.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=self.device, max_sequence_length=TEXT_LENGTH
        )
        return [{"encoder_hidden_states": e.float()} for e in prompt_embeds]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        b, c, h, w = latents.shape
        device = latents.device
        text = stack_context(context, "encoder_hidden_states").to(device)
        positions = torch.arange(text.shape[1], device=device, dtype=text.dtype)
        txt_ids = torch.stack([torch.zeros_like(positions), positions, positions], dim=-1)
        return {
            "hidden_states": OvisImagePipeline._pack_latents(latents, b, c, h, w),
            "encoder_hidden_states": text,
            "timestep": sigmas.to(device),
            "img_ids": OvisImagePipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, text.dtype),
            "txt_ids": txt_ids,
        }
