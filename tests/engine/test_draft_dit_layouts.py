"""`patchgen draft` of DiTs that lay their tokens out in their own module: Lumina2 (a RoPE module returning several
tables, refiners per stream, a joint [caption, image, padding] sequence with a key mask, a processor calling torch's
`F.scaled_dot_product_attention` with one complex RoPE tensor, a final norm that projects) and HunyuanVideo (RoPE
tables of the flattened latent grid, a text token refiner with attention of its own, blocks that slice tokens at a
count from the sequence's start under a config switch). Each rule is held to upstream's code read by draft, and the
token dims it reads to what upstream's RoPE modules compute (torch, a few seconds)."""

from __future__ import annotations

import libcst as cst
import pytest

from patchgen.config import load_config
from patchgen.cst.prune import parsed, reachable_definitions
from patchgen.draft.dit import _rotary
from patchgen.draft.dit_joint import joint_sequence
from patchgen.draft.dit_layout import assign_of, canonical, projects
from patchgen.draft.dit_processors import complex_rotary, default_processors
from patchgen.draft.dit_rope_tables import flat_rotary_dim, position_rotary_dim
from patchgen.draft.dit_text import text_refiners
from patchgen.draft.dit_token_index import global_token_counts
from patchgen.draft.reproduce import reproduce
from patchgen.draft.structure import Module, dotted
from patchgen.upstream import PinnedSource
from tests.engine.helpers import REPO

FITTED = ("record tiny: ", "record data: ", "record capabilities: ", "only the patches' why")
MODULES = {
    "lumina2": ("diffusers.models.transformers.transformer_lumina2", "Lumina2Transformer2DModel"),
    "hunyuan": ("diffusers.models.transformers.transformer_hunyuan_video", "HunyuanVideoTransformer3DModel"),
    "flux": ("diffusers.models.transformers.transformer_flux", "FluxTransformer2DModel"),
    "wan": ("diffusers.models.transformers.transformer_wan", "WanTransformer3DModel"),
}


def _module(name: str) -> tuple[Module, str, list[cst.CSTNode]]:
    """The parsed upstream module, its transformer class and the top-level statements of that class's forward."""
    module, cls = MODULES[name]
    mod = Module(PinnedSource(load_config(REPO).pins).read(module))
    return mod, cls, list(mod.method(cls, "forward").body.body)


@pytest.mark.parametrize("name", ["lumina2", "hunyuanvideo"])
def test_draft_reproduces_the_shipped_code(name: str) -> None:
    """Drafted from the diffusers class without the spec, generated: the committed module's code; the record
    differs only where it is fitted to the hand-written condition model."""
    config = load_config(REPO)
    outcome = reproduce(config, name, PinnedSource(config.pins))
    assert outcome.code_equal, outcome.why
    assert all(r.startswith(FITTED) for r in outcome.why.split("; ")), outcome.why


def test_rope_table_token_dims_are_what_upstream_computes() -> None:
    """HunyuanVideo joins per-axis tables of the flattened grid along the features: tokens on dim 0. Lumina2 gathers
    its joint table per position from (batch, tokens, axes) ids: tokens on dim 1. Upstream's modules, run, agree."""
    import torch
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed
    from diffusers.models.transformers.transformer_lumina2 import Lumina2RotaryPosEmbed

    hunyuan, lumina = _module("hunyuan")[0], _module("lumina2")[0]
    assert flat_rotary_dim(hunyuan, "HunyuanVideoRotaryPosEmbed") == 0
    cos, sin = HunyuanVideoRotaryPosEmbed(1, 1, [4, 4, 4])(torch.zeros(1, 4, 2, 3, 5))
    assert cos.shape[0] == sin.shape[0] == 2 * 3 * 5 and cos.shape[1] != 2 * 3 * 5
    assert position_rotary_dim(lumina, "Lumina2RotaryPosEmbed", 3) == 1  # freqs_cis, the joint sequence's table
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # captions of 3 and 2 tokens
    out = Lumina2RotaryPosEmbed(10000, [4, 2, 2], patch_size=2)(torch.zeros(2, 4, 8, 8), mask)
    assert out[3].shape[:2] == (2, max(out[5])) == (2, 3 + 16)
    # not read: the caption's own table (built as zeros, no position ids), Wan's and Flux's tables
    assert position_rotary_dim(lumina, "Lumina2RotaryPosEmbed", 1) is None
    assert flat_rotary_dim(_module("wan")[0], "WanRotaryPosEmbed") is None
    assert flat_rotary_dim(_module("flux")[0], "FluxPosEmbed") is None


def test_a_text_refiner_with_its_own_attention_runs_before_the_split() -> None:
    """HunyuanVideo's `context_embedder` (a token refiner whose Attention keeps diffusers' default processor) right
    after the patch embedding: the split goes after it and it keeps upstream's processor. Flux's context embedder
    is a Linear: no refiner."""
    mod, cls, body = _module("hunyuan")
    embed = next(i for i, s in enumerate(body) if canonical(s) == "hidden_states = self.x_embedder(hidden_states)")
    end, refiners = text_refiners(mod, cls, body, embed, ["HunyuanVideoAttnProcessor2_0"])
    assert refiners == ["context_embedder"] and end == embed + 1
    assert assign_of(body[end])[0] == "encoder_hidden_states"
    mod, cls, body = _module("flux")
    for i in range(len(body)):
        assert text_refiners(mod, cls, body, i, ["FluxAttnProcessor"]) == (i, [])


def test_blocks_that_slice_tokens_at_a_global_count_are_refused_where_the_count_is_computed() -> None:
    """HunyuanVideo builds token-replace blocks under `image_condition_type == "token_replace"`; their forward slices
    `x[:, :num_tokens]`, the forward's `first_frame_num_tokens`: one refusal (the single- and double-stream blocks
    share the switch), after the statement computing the count. Wan's blocks slice no token count."""
    mod, cls, body = _module("hunyuan")
    [(rvars, after, note)] = global_token_counts(mod, cls, body)
    assert rvars["when"] == "self.config.image_condition_type == 'token_replace'"
    assert "`first_frame_num_tokens`" in rvars["reason"] and "HunyuanVideoTokenReplaceTransformerBlock" in note
    assert after == "first_frame_num_tokens = 1 * post_patch_height * post_patch_width"
    assert global_token_counts(*_module("wan")) == []


def test_a_processor_calling_torch_sdpa_with_one_complex_rope_tensor() -> None:
    """Lumina2's processor makes one `F.scaled_dot_product_attention` call and applies its RoPE with
    `use_real=False` (one complex tensor: unwrapped by dit/rotary_tensor); HunyuanVideo's applies a (cos, sin) pair."""
    mod, cls, _ = _module("lumina2")
    reachable = sorted(reachable_definitions(parsed(mod.upstream.text, mod.upstream.relpath), [cls]))
    [(name, call)] = default_processors(mod, reachable)
    assert name == "Lumina2AttnProcessor2_0" and dotted(call.func) == "F.scaled_dot_product_attention"
    assert complex_rotary(mod, name, "image_rotary_emb")
    assert not complex_rotary(_module("hunyuan")[0], "HunyuanVideoAttnProcessor2_0", "image_rotary_emb")


def test_the_joint_sequence_is_split_before_the_main_blocks() -> None:
    """Lumina2: the table the main blocks take (`rotary_emb`, not the refiners' caption and image tables), the key
    mask created of the joint sequence's (batch, length), the split after `hidden_states = joint_hidden_states`; the
    output gathered after the norm that projects (`out_dim`). Not a joint layout: HunyuanVideo, Flux."""
    mod, cls, body = _module("lumina2")
    joint = joint_sequence(mod, cls, body, lambda c: _rotary(mod, c))
    assert (joint.rotary, joint.dim, joint.tokens) == ("rotary_emb", 1, ["attention_mask"])
    assert canonical(body[joint.split]) == "hidden_states = joint_hidden_states"
    assert projects(mod, cls, "norm_out") and not projects(mod, cls, "x_embedder")
    for name in ("hunyuan", "flux"):
        mod, cls, body = _module(name)
        assert joint_sequence(mod, cls, body, lambda c, mod=mod: _rotary(mod, c)) is None
    assert not projects(*_module("hunyuan")[:2], "norm_out")
