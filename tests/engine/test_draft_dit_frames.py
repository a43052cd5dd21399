"""`patchgen draft` of a DiT whose forward repeats per-frame conditioning over each frame's tokens (SkyReels-V2:
diffusion forcing), builds a (tokens x tokens) mask under a config switch, computes its RoPE tables from the latent
grid, and parallelises an image cross-attention beside the self-attention: the drafted patches generate the shipped
module but for the shipped spec's hand choice (no [model] record, so no training shell). Renders and generates
without torch (a few seconds)."""

from __future__ import annotations

import tomllib

from patchgen.config import load_config
from patchgen.draft.loading import load_drafted
from patchgen.draft.pipeline import draft_spec, drafted_from
from patchgen.draft.reproduce import MARKER_WHY, NOT_REPRODUCED, reproduce
from patchgen.generate import generate
from patchgen.header import split
from patchgen.upstream import PinnedSource
from tests.engine.helpers import REPO

SHIPPED = tomllib.loads((REPO / "specs" / "skyreels_v2.toml").read_text(encoding="utf-8"))


def test_a_spec_without_a_model_record_is_drafted_as_the_dit_it_keeps() -> None:
    """skyreels_v2 states no [model] (no condition model here): reproduce drafts it from the diffusers class it
    keeps, not as a language model, and names the missing record."""
    assert drafted_from(SHIPPED, "skyreels_v2") == ("SkyReelsV2Transformer3DModel", True)
    assert drafted_from({"model": {"model_type": "llama"}}, "llama") == ("llama", False)
    config = load_config(REPO)
    outcome = reproduce(config, "skyreels_v2", PinnedSource(config.pins))
    assert not outcome.code_equal and "record: drafted only (the shipped spec states no [model])" in outcome.why
    assert "hand choice" in NOT_REPRODUCED["skyreels_v2"]


def test_the_drafted_patches_generate_the_shipped_module_but_for_the_hand_choices() -> None:
    """Drafted from the class: the self-attention among two parallelised calls (the one whose key the RoPE
    rotates), the RoPE split on the token dim of the grid's tables, `temb` (dim 1) and `timestep_proj` (dim 2 after
    its transpose) sliced after the per-frame repeat, the block-causal mask refused under SP (the shipped reason is
    draft's). With the shipped spec's hand choice applied (no [model] record, so no training shell: no condition
    model here), the generated module equals the committed one (the markers' why aside)."""
    config = load_config(REPO)
    source = PinnedSource(config.pins)
    text = draft_spec("SkyReelsV2Transformer3DModel", source, config.pins, "skyreels_v2").text
    drafted = tomllib.loads(text)
    assert "unsupported" not in drafted["model"]
    templates = [p["template"] for p in drafted["patch"]]
    assert templates == [p["template"] for p in SHIPPED["patch"]] + ["dit/training_shell"]
    frames = [p["vars"] for p in drafted["patch"] if p["template"] == "dit/shard_per_token"]
    assert frames == [
        {"tensor": "temb", "when": "temb.ndim == 3"},
        {"tensor": "timestep_proj", "when": "timestep_proj.ndim == 4", "dim": 2},
    ]
    [refuse] = [p["vars"] for p in drafted["patch"] if p["template"] == "dit/refuse_under_sp"]
    [shipped] = [p["vars"] for p in SHIPPED["patch"] if p["template"] == "dit/refuse_under_sp"]
    assert refuse["when"] == shipped["when"] == "self.config.num_frame_per_block > 1"
    assert "causal_mask" in refuse["reason"] and "key masks only" in refuse["reason"]
    assert refuse["reason"] == shipped["reason"]

    # the shipped spec's hand choice: no [model] record (so no training shell)
    preamble, *patches = text.split("\n[[patch]]\n")
    kept = [p for p in patches if 'template = "dit/training_shell"' not in p]
    text = preamble[: preamble.index("\n[model]\n")] + "".join(f"\n[[patch]]\n{p}" for p in kept)
    spec = load_drafted(config, "skyreels_v2", text)
    assert spec.model is None and len(spec.patches) == len(SHIPPED["patch"])
    [module] = [f for f in generate(spec, source, config).files if f.relpath.endswith(".py")]
    committed = (REPO / module.relpath).read_text(encoding="utf-8")
    assert MARKER_WHY.sub(r"\1", split(module.text)[1]) == MARKER_WHY.sub(r"\1", split(committed)[1])
