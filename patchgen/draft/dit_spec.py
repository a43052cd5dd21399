"""A drafted DiT spec: the tiny config by draft's DiT rule and the spec text (module, output, `[model]` with the
training shell as its class, `[model.data]` naming the condition model, then the recognised patches)."""

from __future__ import annotations

from typing import Any

from patchgen.draft.lm import Recognised
from patchgen.draft.render import _patch, _table, value
from patchgen.draft.structure import Module

# Rule (docs/adding-a-model.md, `patchgen draft`): 2 blocks (1 double-stream + 1 single-stream where both exist),
# 4 heads of 16 (sp = 2 and 4 divide the heads; RoPE axes 4/6/6), 4 latent channels, text/condition widths 16-32,
# feed-forward 64; every other __init__ parameter keeps its default.
DIT_TINY: dict[str, Any] = {
    "num_layers": 2,
    "num_single_layers": 1,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 32,
    "ffn_dim": 64,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "cross_attention_dim": 32,
    "caption_channels": 32,
    "axes_dims_rope": [4, 6, 6],
    "rope_max_seq_len": 64,
}


def dit_tiny(mod: Module, cls: str) -> dict[str, Any]:
    """The rule above applied to the parameters of `cls.__init__`."""
    init = mod.method(cls, "__init__")
    params = [p.name.value for p in init.params.params] if init is not None else []
    tiny = {k: v for k, v in DIT_TINY.items() if k in params}
    if "num_single_layers" in tiny:
        tiny["num_layers"] = 1
    if "guidance_embeds" in params:  # the guidance embedding is a patched path's input: on
        tiny["guidance_embeds"] = True
    return tiny


def dit_capabilities(mod: Module, cls: str) -> list[str]:
    """video: a 3D class; guidance: a guidance embedding; image_condition: an image-embedding input width."""
    init = mod.method(cls, "__init__")
    params = [p.name.value for p in init.params.params] if init is not None else []
    found = {"video": "3D" in cls, "guidance": "guidance_embeds" in params, "image_condition": "image_dim" in params}
    return [name for name, present in found.items() if present]


def dit_spec_text(found: Recognised, pin: str, tiny: dict[str, Any], capabilities: list[str]) -> str:
    """The whole DiT spec file, deterministic for one upstream release."""
    target = found.target
    stem = target.module.rsplit(".", 1)[1]
    lines = [
        f"# {target.cls}: drafted by `patchgen draft {target.cls}` from {pin} {found.upstream.relpath}.",
        "# Each patch's comment says what draft recognised upstream and where; edit by hand only what it could not.",
        f'module = "{target.module}"',
        f'output = "generated/{target.name}_dit/{stem}.py"',
        f"keep = {value([target.cls])}",
        "",
    ]
    model = {
        "model_type": target.name,
        "class": f"{target.cls}ForTraining",
        "upstream": f"diffusers.{target.cls}",
        "family": "dit",
    }
    if capabilities:
        model["capabilities"] = capabilities
    lines += [*_table("model", model), ""]
    lines += ["# tiny random config by draft's DiT rule (docs/adding-a-model.md); fit it to the condition model's"]
    lines += [*_table("model.tiny", tiny), ""]
    lines += [f"# the frozen condition model: runtime/diffusion/conditions/{target.name}.py (written by hand)"]
    lines += [*_table("model.data", {"condition_model_type": target.name}), ""]
    if found.unsupported:
        lines += ["# not recognised (draft never guesses): the runtime refuses these layouts quoting the reason"]
        lines += [*_table("model.unsupported", found.unsupported), ""]
    for patch in found.patches:
        lines += [*_patch(patch), ""]
    return "\n".join(lines).rstrip("\n") + "\n"
