"""`patchgen draft`: a decoder LM's spec drafted from the pinned upstream module reproduces the shipped one (the
generated code and the model record), a DiT's drafted from its diffusers class reproduces the generated code,
`--check` shows a hand edit, what draft does not recognise is stated, and bad input is one line with exit 2.
Renders and generates without torch (about 15 s on one core), except the four unseen models (three LMs, a DiT)
built and compared with upstream (about 3 s each once torch is imported)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.draft.pipeline import draft_spec
from patchgen.draft.reproduce import NOT_REPRODUCED, reproduce
from patchgen.upstream import PinnedSource
from tests.engine.helpers import REPO
from tests.engine.test_cli import expression_line, in_process, installed_transformers


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """The project's pyproject, specs and templates (what draft and its in-memory generation read)."""
    root = tmp_path / "proj"
    root.mkdir()
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    for name in ("specs", "templates"):
        shutil.copytree(REPO / name, root / name)
    return root


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "glm4_moe", "gpt_oss"])
def test_draft_reproduces_the_shipped_lm(name: str) -> None:
    """Drafted without the spec, generated: the committed module's code and its record (tiny config included).
    gpt_oss: eager attention wrapped (transformers refuses sdpa), mask builders without position ids, biased
    experts in the EP plan; qwen3_moe: the builder chosen by the config, the load-balancing loss; glm4_moe: an
    aux-loss-free router, a leading dense layer, partial rotary; qwen2: a spec that extends qwen3, drafted whole."""
    config = load_config(REPO)
    outcome = reproduce(config, name, PinnedSource(config.pins))
    assert outcome.code_equal and outcome.record_equal, outcome.why


@pytest.mark.parametrize("name", ["mimo_v2_flash"])
def test_a_hand_chosen_tiny_config_is_the_only_difference(name: str) -> None:
    """The code is reproduced; the record differs in the tiny config alone, a hand choice that reproduce names
    (NOT_REPRODUCED, docs/adding-a-model.md): draft's rule stays one rule for every model."""
    config = load_config(REPO)
    outcome = reproduce(config, name, PinnedSource(config.pins))
    assert outcome.code_equal and not outcome.record_equal
    reasons = outcome.why.split("; ")
    assert reasons[0].startswith("record tiny: ") and all(
        r == "only the patches' why in the markers differs" for r in reasons[1:]
    ), outcome.why
    assert "hand choice" in NOT_REPRODUCED[name]


@pytest.mark.parametrize("name", ["wan", "flux", "qwenimage", "ltx_video"])
def test_draft_reproduces_the_shipped_dit_code(name: str) -> None:
    """A DiT drafted from its diffusers class generates the committed module: the token split and the gather read
    from diffusers' context-parallel plan, the RoPE slice (flux: text positions first; qwenimage: the image part of
    a (image, text) pair), per-token timesteps (wan: by the plan; ltx_video: a timestep embedded flat whose
    embedding the forward views back per token), the joint attention's replicated text (flux, qwenimage). The
    record differs only where it is fitted to the hand-written condition model."""
    config = load_config(REPO)
    outcome = reproduce(config, name, PinnedSource(config.pins))
    assert outcome.code_equal, outcome.why
    fitted = ("record tiny: ", "record data: ", "record capabilities: ", "only the patches' why")
    assert all(r.startswith(fitted) for r in outcome.why.split("; ")), outcome.why


def test_draft_of_a_dit_writes_its_spec(scratch: Path, capsys) -> None:
    """`patchgen draft <diffusers class>` names the spec after the module, and the written spec regenerates."""
    (scratch / "specs" / "flux.toml").unlink()
    code, out, err = in_process(scratch, capsys, "draft", "FluxTransformer2DModel")
    assert code == 0 and out.startswith("wrote specs/flux.toml: 9 patches"), (out, err)
    spec = tomllib.loads((scratch / "specs" / "flux.toml").read_text())
    assert spec["output"] == "generated/flux_dit/transformer_flux.py" and spec["model"]["family"] == "dit"
    assert in_process(scratch, capsys, "draft", "--check", "flux")[:2] == (0, "flux.toml: equal to the draft\n")


def test_a_dit_without_a_context_parallel_plan_is_stated() -> None:
    """PixArt declares no _cp_plan and its blocks build no processor (diffusers' Attention picks one itself, for the
    self- and the cross-attention alike), so draft reads no split of its attention: no SP patch, the reason names the
    block's Attention with its file:line, the shell stays."""
    config = load_config(REPO)
    drafted = draft_spec("PixArtTransformer2DModel", PinnedSource(config.pins), config.pins)
    spec = tomllib.loads(drafted.text)
    assert [p["template"] for p in spec["patch"]] == ["dit/training_shell"]
    reason = spec["model"]["unsupported"]["sp"]
    assert "BasicTransformerBlock (diffusers/models/attention.py:" in reason
    assert "builds Attention with no processor" in reason


def test_a_dit_without_a_plan_is_split_as_its_forward_lays_the_tokens_out() -> None:
    """Bria states no _cp_plan: draft reads the plan diffusers would state from the forward (the patchified
    `hidden_states`, the RoPE positions `torch.cat((txt_ids, img_ids), dim=0)` joins, the output projection) and
    places Flux's kinds as for Flux's own plan; its guidance embedding, which diffusers' class cannot build (a
    missing argument), stays off."""
    config = load_config(REPO)
    flux = tomllib.loads(draft_spec("FluxTransformer2DModel", PinnedSource(config.pins), config.pins).text)
    bria = tomllib.loads(draft_spec("BriaTransformer2DModel", PinnedSource(config.pins), config.pins).text)
    assert "unsupported" not in bria["model"] and "guidance_embeds" not in bria["model"]["tiny"]
    assert [p["template"] for p in bria["patch"]] == [p["template"] for p in flux["patch"]]
    for mine, theirs in zip(bria["patch"][:-1], flux["patch"][:-1], strict=True):
        vars_ = {k: v for k, v in theirs.get("vars", {}).items() if k != "processors"}
        assert {k: v for k, v in mine.get("vars", {}).items() if k != "processors"} == vars_, mine["template"]
    [shard] = [p for p in bria["patch"] if p["template"] == "dit/shard_tokens"]
    assert shard["vars"]["processors"] == ["BriaAttnProcessor"]


def test_a_vlm_family_member_extends_the_shipped_spec() -> None:
    """Qwen3-VL-MoE drafted without its spec: `extends = "qwen3_vl"` with the class prefix renamed (every inherited
    anchor matches once in the new module) plus the MoE patches the LM recogniser finds in its text model; the
    generated code and the record are the committed ones: the expert width 48 because transformers transposes its
    released experts where their shape says so (no square expert matrix), and no `output_router_logits` in a text
    config that does not declare it (the forward reads it from its kwargs)."""
    config = load_config(REPO)
    outcome = reproduce(config, "qwen3_vl_moe", PinnedSource(config.pins))
    assert outcome.code_equal and outcome.record_equal, outcome.why
    drafted = tomllib.loads(draft_spec("qwen3_vl_moe", PinnedSource(config.pins), config.pins, project=config).text)
    assert drafted["extends"] == "qwen3_vl" and drafted["class_prefix"] == {"from": "Qwen3VL", "to": "Qwen3VLMoe"}
    assert [p["template"] for p in drafted["patch"]] == ["moe/global_aux_loss", "moe/ep_plan"]
    text = drafted["model"]["tiny"]["text_config"]
    assert text["moe_intermediate_size"] == 48 and "output_router_logits" not in text


@pytest.mark.parametrize(
    ("cls", "condition", "reason"),
    [
        ("ChronoEditTransformer3DModel", "wan", None),  # Wan's forward inputs: Wan's condition model
        ("BriaTransformer2DModel", "flux", None),  # Flux's inputs (its kwargs dict named otherwise): Flux's
        ("NucleusMoEImageTransformer2DModel", "qwenimage", "no split of the RoPE tables"),  # a subset of Qwen-Image's
        ("LongCatImageTransformer2DModel", "longcat_image", None),  # no pooled projections: Flux's feeds them
        ("SanaVideoTransformer3DModel", "sana_video", "no split of the RoPE tables"),  # Sana's inputs, video latents
        ("HeliosTransformer3DModel", "helios", "states a _cp_plan that is no literal"),  # `**other` inside
    ],
)
def test_an_unseen_dit_gets_a_condition_model_only_with_the_same_inputs(
    cls: str, condition: str, reason: str | None
) -> None:
    """A DiT the project does not ship takes a shipped DiT's condition model only when its diffusers class takes
    the same forward inputs (every one that condition model feeds, none the shipped class lacks; kwargs dicts and
    ControlNet residuals aside) with latents of as many dims; else its own name, left to write (the comment says
    so). NucleusMoE-Image takes Qwen-Image's less three it is not fed; LongCat-Image lacks the pooled projection
    Flux's feeds."""
    config = load_config(REPO)
    drafted = draft_spec(cls, PinnedSource(config.pins), config.pins, project=config)
    spec = tomllib.loads(drafted.text)
    assert spec["model"]["data"]["condition_model_type"] == condition
    assert spec["patch"][-1]["vars"]["condition_model_type"] == condition
    if reason is None:
        kinds = [p["template"] for p in spec["patch"] if p["template"] != "dit/refuse_under_sp"]  # ControlNet aside
        assert "unsupported" not in spec["model"] and len(kinds) == 7
    else:
        assert f"{cls}" in spec["model"]["unsupported"]["sp"] and reason in spec["model"]["unsupported"]["sp"]
        assert "diffusers/models/transformers/" in spec["model"]["unsupported"]["sp"]
    shipped = (REPO / "runtime" / "diffusion" / "conditions" / f"{condition}.py").is_file()
    if shipped:
        assert f"# the frozen condition model: runtime/diffusion/conditions/{condition}.py, " in drafted.text
    else:
        assert f"none yet: write runtime/diffusion/conditions/{condition}.py" in drafted.text


def test_draft_writes_a_spec_whose_comments_say_where(scratch: Path, capsys) -> None:
    (scratch / "specs" / "llama.toml").unlink()
    code, out, err = in_process(scratch, capsys, "draft", "llama")
    assert code == 0 and out.startswith("wrote specs/llama.toml: 4 patches"), (out, err)
    text = (scratch / "specs" / "llama.toml").read_text()
    upstream = installed_transformers()[0] / "models" / "llama" / "modeling_llama.py"
    line = expression_line(upstream, "LlamaModel.forward", "self.rotary_emb(hidden_states, position_ids=position_ids)")
    assert f"transformers/models/llama/modeling_llama.py:{line}\n" in text
    spec = tomllib.loads(text)
    assert [p["template"] for p in spec["patch"]] == [
        "sp/full_sequence_mask",
        "sp/rope_slice",
        "sp/ulysses_attention",
        "loss/causal_lm_head",
    ]
    assert list(scratch.glob("specs/.*")) == []  # the atomic write leaves no staging file
    assert in_process(scratch, capsys, "draft", "--check", "llama")[:2] == (0, "llama.toml: equal to the draft\n")


def test_stdout_prints_the_draft_and_writes_nothing(scratch: Path, capsys) -> None:
    """`--stdout`: the spec text alone on stdout (where a spec exists too), what was found on stderr, no file; the
    text is what the draft then writes."""
    code, out, err = in_process(scratch, capsys, "draft", "--stdout", "llama")
    assert code == 0 and err.startswith("drafted specs/llama.toml (not written): 4 patches"), (out, err)
    assert tomllib.loads(out)["model"]["model_type"] == "llama"
    (scratch / "specs" / "llama.toml").unlink()
    assert in_process(scratch, capsys, "draft", "--stdout", "llama")[:2] == (0, out)
    assert not (scratch / "specs" / "llama.toml").exists() and list(scratch.glob("specs/.*")) == []
    assert in_process(scratch, capsys, "draft", "llama")[0] == 0
    assert (scratch / "specs" / "llama.toml").read_text() == out


def test_check_shows_a_hand_edit(scratch: Path, capsys) -> None:
    """The shipped qwen3 spec differs from its draft only in comments; a changed anchor shows as its own line."""
    path = scratch / "specs" / "qwen3.toml"
    path.write_text(path.read_text().replace('anchor = "create_sliding_window_causal_mask"', 'anchor = "x"'))
    code, out, _ = in_process(scratch, capsys, "draft", "--check", "qwen3")
    assert code == 1
    assert '-anchor = "x"\n' in out and '+anchor = "create_sliding_window_causal_mask"\n' in out


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        ("lama", "not a model type of transformers==5.14.1; did you mean llama"),
        ("AutoencoderKL", "AutoencoderKL is not a transformer"),
        ("FluxTransformer2DModel", "specs/flux.toml exists: draft never overwrites a spec silently"),
        ("torch.nn.Linear", "'torch' is outside the pinned packages"),
        ("qwen2_vl", "a VLM (Qwen2VLForConditionalGeneration) whose module is no shipped VLM spec's"),
        ("llama", "specs/llama.toml exists: draft never overwrites a spec silently"),
    ],
)
def test_bad_input_is_one_line_exit_2(scratch: Path, capsys, argument: str, expected: str) -> None:
    before = (scratch / "specs" / "llama.toml").read_bytes()
    code, out, err = in_process(scratch, capsys, "draft", argument)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err, err
    assert (scratch / "specs" / "llama.toml").read_bytes() == before


def test_force_replaces_an_existing_spec(scratch: Path, capsys) -> None:
    path = scratch / "specs" / "llama.toml"
    path.write_text(path.read_text() + "# a hand note\n")
    code, out, _ = in_process(scratch, capsys, "draft", "--force", "llama")
    assert code == 0 and "# a hand note" not in path.read_text()


def test_an_unrecognised_mixer_is_stated_not_guessed() -> None:
    """minimax interleaves a lightning (linear) attention with softmax attention: no SP kind splits it, so the draft
    has no SP patch at all and names the class with its file:line in [model.unsupported]."""
    config = load_config(REPO)
    drafted = draft_spec("minimax", PinnedSource(config.pins), config.pins)
    spec = tomllib.loads(drafted.text)
    assert not any(p["template"].startswith(("sp/", "loss/")) for p in spec.get("patch", []))
    reason = spec["model"]["unsupported"]["sp"]
    assert "MiniMaxLightningAttention (transformers/models/minimax/modeling_minimax.py:" in reason


@pytest.mark.parametrize(
    "model_type", ["mistral", "olmo2", "glm4", "gemma2", "mixtral", "olmoe", "ernie4_5_moe", "deepseek_v3"]
)
def test_an_unseen_model_drafted_is_bitwise_upstream_with_parallelism_off(model_type: str, tmp_path: Path) -> None:
    """A model the project does not ship (the eight tests/train/test_drafted_trainer.py trains: mistral, a sliding
    window; olmo2, q/k norms over all heads; glm4, partial rotary and extra norms; gemma2, softcaps and alternating
    windows; mixtral and olmoe, MoE with a load-balancing loss; ernie4_5_moe, a router's score-correction bias;
    deepseek_v3, latent attention, grouped routing, a leading dense layer), drafted with no hand edit and generated
    into a scratch package (``tests.engine.drafted``): logits, loss and every gradient equal to upstream's on the
    draft's tiny config."""
    import json

    import torch

    from tests.engine.drafted import drafted_installed, generate_drafted
    from tests.parity.dense import grads, models, packed_batch

    drafted = generate_drafted(model_type, tmp_path)
    assert drafted.model_type == model_type and json.loads(drafted.record.read_text())["supports"]["sp"] is True
    with drafted_installed(tmp_path, [drafted]):
        upstream, generated_model = models(model_type)
        assert type(generated_model).__module__ == drafted.module
        batch = packed_batch((7, 10, 4))
        outputs = [m(**batch) for m in (upstream, generated_model)]
        assert torch.equal(outputs[0].logits, outputs[1].logits)
        assert torch.equal(outputs[0].loss, outputs[1].loss)
        for out in outputs:
            out.loss.backward()
        ref, got = grads(upstream), grads(generated_model)
    assert ref.keys() == got.keys() and len(ref) > 10
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.mark.parametrize(
    ("cls", "condition"),
    [
        ("ChronoEditTransformer3DModel", "wan"),
        ("BriaTransformer2DModel", "flux"),
        ("OvisImageTransformer2DModel", "ovis_image"),
    ],
)
def test_an_unseen_dit_drafted_is_bitwise_upstream_with_parallelism_off(
    cls: str, condition: str, tmp_path: Path
) -> None:
    """An unseen DiT drafted with no hand edit and generated into a scratch package: output, loss and every gradient
    equal to diffusers' class on the draft's tiny config. ChronoEdit: split by diffusers' context-parallel plan,
    Wan's condition model (so Wan's example inputs); Bria: no plan, split as its forward lays the tokens out, Flux's
    condition model."""
    import torch

    from runtime.diffusion.registry import tiny_config
    from tests.dit.cases import Case, inputs, loss_and_grads, shell, upstream_like
    from tests.engine.drafted import drafted_installed, generate_drafted

    drafted = generate_drafted(cls, tmp_path)
    with drafted_installed(tmp_path, [drafted]):
        case = Case(drafted.model_type, drafted.model_type, None, tiny_config(drafted.model_type))
        assert case.condition_model_type == condition and case.shell_class.__module__ == drafted.module
        model = shell(case)
        kwargs = inputs(case)
        out, loss, grads = loss_and_grads(model, kwargs)
        ref_out, ref_loss, ref_grads = loss_and_grads(upstream_like(case, model), kwargs)
    assert torch.equal(out, ref_out) and torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and sum(g is not None for g in grads.values()) > 10
    for key, grad in ref_grads.items():
        assert (grads[key] is None and grad is None) or torch.equal(grads[key], grad), key
