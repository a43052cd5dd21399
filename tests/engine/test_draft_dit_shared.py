"""`patchgen draft` of a DiT whose blocks build attention processors of diffusers' shared modules (SD3, AuraFlow,
CogVideoX: `F.scaled_dot_product_attention` on (b, h, s, d) tensors in attention_processor.py): the processors (and
a shared-module block that builds one) are drafted as companions, the split reaches them through the kwargs dict the
blocks pass `self.attn`, a RoPE input is sliced on the token dim diffusers' `apply_rotary_emb` reads its tables on;
what draft cannot read stays `[model.unsupported]` with file:line. Renders and generates without torch."""

from __future__ import annotations

import tomllib

import libcst as cst
import pytest

from patchgen.config import load_config
from patchgen.cst.locate import normalize_anchor
from patchgen.draft.dit_rotary import _broadcast_dim
from patchgen.draft.pipeline import draft_spec
from patchgen.draft.reproduce import reproduce
from patchgen.upstream import PinnedSource
from tests.engine.helpers import REPO

FITTED = ("record tiny: ", "record data: ", "record capabilities: ", "only the patches' why")


def _draft(cls: str) -> dict:
    config = load_config(REPO)
    return tomllib.loads(draft_spec(cls, PinnedSource(config.pins), config.pins).text)


def _placed(patch: dict) -> dict:
    """What a patch does and where: its anchors in canonical form (quotes and layout aside)."""
    out = {k: patch[k] for k in ("template", "scope", "vars") if k in patch}
    return out | {k: normalize_anchor(patch[k]) for k in ("anchor", "before", "after") if k in patch}


def _shipped(name: str) -> dict:
    return tomllib.loads((REPO / "specs" / f"{name}.toml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["cogvideox", "auraflow", "sd3"])
def test_draft_reproduces_the_shipped_code(name: str) -> None:
    """CogVideoX (every block call passes attention_kwargs: the split is carried into it before the blocks run; the
    pipeline's RoPE tables sliced on dim 0), AuraFlow (its checkpointed block calls omit attention_kwargs: the split
    is handed to every block call and carried inside each block) and SD3 (its block a companion too) generate the
    committed modules."""
    config = load_config(REPO)
    outcome = reproduce(config, name, PinnedSource(config.pins))
    assert outcome.code_equal, outcome.why
    assert all(r.startswith(FITTED) for r in outcome.why.split("; ")), outcome.why


def test_an_sd3_like_dit_gets_the_shipped_patches() -> None:
    """SD3: the block (attention.py) and its processor (attention_processor.py) both companions, the split carried
    into joint_attention_kwargs after the last statement before the blocks run, the text last in the joint
    sequence, the ControlNet residuals refused first; each patch where the shipped spec puts it."""
    drafted = _draft("SD3Transformer2DModel")
    assert "unsupported" not in drafted["model"]
    assert drafted["companion"] == [
        {"module": "diffusers.models.attention_processor", "keep": ["JointAttnProcessor2_0"]},
        {"module": "diffusers.models.attention", "keep": ["JointTransformerBlock"]},
    ]
    shipped = _shipped("sd3")["patch"]
    assert [_placed(p) for p in drafted["patch"]] == [_placed(p) for p in shipped]


def test_a_processor_draft_cannot_read_stays_unsupported() -> None:
    """Sana's self-attention processor (shared module) is linear attention, no `F.scaled_dot_product_attention`:
    no SP patch, the reason names the processor with its file:line, the shell stays."""
    drafted = _draft("SanaTransformer2DModel")
    assert [p["template"] for p in drafted["patch"]] == ["dit/training_shell"]
    assert "companion" not in drafted
    reason = drafted["model"]["unsupported"]["sp"]
    assert "SanaLinearAttnProcessor2_0 (diffusers/models/attention_processor.py:" in reason


def test_the_rope_tables_token_dim_is_read_from_the_broadcast() -> None:
    """The tables' token dim is the count of sliced places before the tokens' dim in the branch the call takes;
    a broadcast with anything but None and slices is not read."""

    def dim(body: str, sequence: int) -> int | None:
        function = cst.parse_module(f"def f(x, t, sequence_dim=2):\n{body}").body[0]
        return _broadcast_dim(function, sequence)

    diffusers = "    if sequence_dim == 2:\n        t = t[None, None, :, :]\n    elif sequence_dim == 1:\n"
    diffusers += "        t = t[None, :, None, :]\n"
    assert dim(diffusers, 2) == 0 and dim(diffusers, 1) == 0
    assert dim("    if sequence_dim == 2:\n        t = t[:, None, :, :]\n", 2) == 1
    assert dim("    if sequence_dim == 2:\n        t = t[None, None, 0, :]\n", 2) is None
    assert dim(diffusers, 3) is None


@pytest.mark.parametrize("cls", ["BriaFiboTransformer2DModel", "ChromaTransformer2DModel"])
def test_processors_of_another_models_module_are_not_shared_ones(cls: str) -> None:
    """Bria-Fibo's blocks build Bria's processor (transformer_bria.py, a model's module, dispatch_attention_fn with
    diffusers' parallel config): drafted with SP as before, no companion; Chroma's imports reach a package
    (`...utils`), which the import reading skips instead of failing."""
    drafted = _draft(cls)
    assert "companion" not in drafted
    if cls == "BriaFiboTransformer2DModel":
        assert "unsupported" not in drafted["model"]
        assert "dit/ulysses_to_heads" in [p["template"] for p in drafted["patch"]]


def test_controlnet_residuals_are_refused_under_sp() -> None:
    """Each `*controlnet*` input a block loop adds to the tokens (Flux: the double- and the single-stream blocks'),
    refused before the forward's first statement, first among the patches; an input of that name the forward only
    reads as a flag (`controlnet_blocks_repeat`) is not one."""
    drafted = _draft("FluxTransformer2DModel")
    refusals = [p for p in drafted["patch"] if p["template"] == "dit/refuse_under_sp"]
    assert drafted["patch"][:2] == refusals
    assert [p["vars"]["when"] for p in refusals] == [
        "controlnet_block_samples is not None",
        "controlnet_single_block_samples is not None",
    ]
    assert {p["before"] for p in refusals} == {"hidden_states = self.x_embedder(hidden_states)"}
    assert [_placed(p) for p in drafted["patch"]] == [_placed(p) for p in _shipped("flux")["patch"]]
