"""A loss patch on a model with a final-logit softcap (transformers' gemma2): refused while regen would delete the
softcap, and, with the loss template's `softcap` set, bitwise upstream with parallelism off (chunked loss too).

Before, the loss template replaced gemma2's lm_head .. loss region, softcap included, and the generated model trained
unsoftcapped logits with exit 0. The spec lives in a temporary project, never in specs/.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.gemma2 import modeling_gemma2

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.engine.helpers import REPO

# The spec below is written against gemma2 of this release (its anchors); `patchgen upgrade --verify` runs the suites
# on a newer one, where the shipped specs (migrated) are what is proven, not this test's own.
WRITTEN_FOR = "5.14.1"
pytestmark = pytest.mark.skipif(
    transformers.__version__ != WRITTEN_FOR,
    reason=f"its gemma2 spec is written for transformers {WRITTEN_FOR}, not {transformers.__version__}",
)

SOFTCAP_HEADER = "if self.config.final_logit_softcapping is not None:"
OUTPUT = "generated/gemma2_softcap/modeling_gemma2.py"


# The softcap's upstream statements, as a spec's `removes` names them (a spec that deletes them on purpose).
SOFTCAP_STATEMENTS = [
    SOFTCAP_HEADER,
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
]
TINY_VARIANT = "[model.data.tiny_variants.softcap]\nfinal_logit_softcapping = 3.0\n"


def spec_text(softcap: bool, claim: str = "honest") -> str:
    """``claim``: honest (the loss patch re-implements what `handles` says), lying (the softcap removed and declared
    handled, no patch re-implementing it), untried (honest, but no tiny config sets the option)."""
    loss_vars = 'vars = { softcap = "self.config.final_logit_softcapping" }\n' if softcap else ""
    handles = 'handles = ["final_logit_softcapping"]\n' if softcap else ""
    if claim == "lying":
        loss_vars = f"removes = {json.dumps(SOFTCAP_STATEMENTS)}\n"
    if softcap and claim != "untried":
        handles += TINY_VARIANT
    return f"""module = "transformers.models.gemma2.modeling_gemma2"
output = "{OUTPUT}"
keep = ["Gemma2ForCausalLM"]

[model]
model_type = "gemma2"
class = "Gemma2ForCausalLM"
upstream = "transformers.AutoModelForCausalLM"
family = "causal_lm"
capabilities = ["sliding_window"]
{handles}
[[patch]]
template = "sp/full_sequence_mask"
scope = "Gemma2Model.forward"
anchor = "create_causal_mask"
why = "the mask of the full gathered sequence"

[[patch]]
template = "sp/full_sequence_mask"
scope = "Gemma2Model.forward"
anchor = "create_sliding_window_causal_mask"
why = "same for sliding-window layers"

[[patch]]
template = "sp/rope_slice"
scope = "Gemma2Model.forward"
anchor = "self.rotary_emb(hidden_states, position_ids)"
why = "RoPE from global position ids, this rank's slice"

[[patch]]
template = "sp/ulysses_attention"
scope = "Gemma2Attention.forward"
anchor = "self.config._attn_implementation"
why = "Ulysses attention under SP"

[[patch]]
template = "loss/causal_lm_head"
scope = "Gemma2ForCausalLM.forward"
anchor = "logits = self.lm_head(hidden_states[:, slice_indices, :])"
through = "if labels is not None:"
{loss_vars}why = "SP-aware, optionally chunked loss"
"""


def project(tmp_path: Path, softcap: bool, claim: str = "honest"):
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/gemma2.toml").write_text(spec_text(softcap, claim))
    config = load_config(tmp_path)
    return config, load_specs(config, ["gemma2"])


def upstream_line_of(text: str) -> int:
    """1-based line of `text` in the installed upstream file (counted here, independently of patchgen)."""
    lines = Path(modeling_gemma2.__file__).read_text().splitlines()
    [number] = [n for n, line in enumerate(lines, start=1) if line.strip() == text]
    return number


def test_regen_refuses_to_delete_the_softcap(tmp_path: Path) -> None:
    config, specs = project(tmp_path, softcap=False)
    with pytest.raises(PatchgenError) as err:
        regen(config, specs)
    lines = str(err.value).splitlines()
    assert len(lines) == 4  # the `if` header and the three statements of its block
    first = lines[0]
    assert "specs/gemma2.toml: patch 5 (loss/causal_lm_head): replacing it deletes upstream" in first
    assert f"line {upstream_line_of(SOFTCAP_HEADER)} `{SOFTCAP_HEADER}` in Gemma2ForCausalLM.forward" in first
    assert all("set vars.softcap (the final-logit softcap" in line for line in lines)
    assert not (tmp_path / OUTPUT).exists()


@pytest.mark.parametrize(
    "claim, message",
    [
        ("lying", "handles 'final_logit_softcapping', but no patch's rendered code reads it"),
        ("untried", "handles 'final_logit_softcapping', but neither [model.tiny] nor a data.tiny_variants table"),
    ],
)
def test_regen_proves_what_handles_claims(tmp_path: Path, claim: str, message: str) -> None:
    """`handles` is believed only when a patch's rendered code reads the option and a tiny config sets it: a spec
    that removes the softcap and says it handles it (what the refusal above suggests) trained unsoftcapped logits."""
    config, specs = project(tmp_path, softcap=True, claim=claim)
    with pytest.raises(PatchgenError) as err:
        regen(config, specs)
    assert str(err.value).startswith(f"{tmp_path / 'specs/gemma2.toml'}: [model] {message}"), str(err.value)
    assert not (tmp_path / OUTPUT).exists()


def tiny_config() -> transformers.Gemma2Config:
    return transformers.Gemma2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,  # one sliding, one full attention layer
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=6,  # shorter than the rows below
        final_logit_softcapping=3.0,  # small enough that tanh bends the random model's logits
        initializer_range=0.2,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )


@pytest.fixture(scope="module")
def generated_class(tmp_path_factory: pytest.TempPathFactory) -> type:
    root = tmp_path_factory.mktemp("gemma2")
    config, specs = project(root, softcap=True)
    regen(config, specs)
    record = json.loads((root / OUTPUT.replace(".py", ".model.json")).read_text())
    assert record["supports"]["handles"] == ["final_logit_softcapping"]
    text = (root / OUTPUT).read_text()
    assert "softcap=self.config.final_logit_softcapping" in text and SOFTCAP_HEADER not in text
    spec = importlib.util.spec_from_file_location("patchgen_test_gemma2_softcap", root / OUTPUT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name)
    return module.Gemma2ForCausalLM


def models(generated_class: type) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    upstream = transformers.Gemma2ForCausalLM(tiny_config())
    generated = generated_class(tiny_config())
    generated.load_state_dict(upstream.state_dict())
    return upstream, generated


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_the_softcap_bites_on_the_tiny_config(generated_class: type) -> None:
    upstream, _ = models(generated_class)
    with torch.no_grad():
        capped = upstream(**batch()).logits
        upstream.config.final_logit_softcapping = None
        plain = upstream(**batch()).logits
    assert capped.abs().max() < 3.0 < plain.abs().max()
    assert (capped - plain).abs().max() > 0.1


def test_bitwise_upstream_with_parallelism_off(generated_class: type) -> None:
    upstream, generated = models(generated_class)
    outputs = [m(**batch()) for m in (upstream, generated)]
    # Same ops in the same order (lm_head, / cap, tanh, * cap, upstream's loss function): exact equality expected.
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    for out in outputs:
        out.loss.backward()
    ref, got = grads(upstream), grads(generated)
    assert ref.keys() == got.keys() and len(ref) == len(list(upstream.parameters()))
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_chunked_loss_applies_the_softcap(generated_class: type) -> None:
    upstream, generated = models(generated_class)
    ref = upstream(**batch())
    got = generated(**batch(), loss_chunk_size=5)
    assert got.logits is None
    # The chunked cross-entropy sums the tokens' losses chunk by chunk and recomputes each chunk's logits in its own
    # backward (fp32 rounding in another order), so it equals upstream to rounding, not bitwise. Without the softcap
    # the loss differs by far more (checked below).
    assert relative_error(got.loss, ref.loss) < 1e-6
    ref.loss.backward()
    got.loss.backward()
    ref_grads, got_grads = grads(upstream), grads(generated)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        assert relative_error(got_grads[name], ref_grads[name]) < 1e-5, name
    upstream.config.final_logit_softcapping = None
    with torch.no_grad():
        plain = upstream(**batch()).loss
    assert relative_error(plain, ref.loss) > 1e-3
