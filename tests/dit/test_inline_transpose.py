"""An attention call that transposes q/k/v inline: diffusers' Cosmos processor holds query/key/value in
(batch, heads, seq, dim) and calls ``dispatch_attention_fn(query.transpose(1, 2), ...)``, which takes and returns
(batch, seq, heads, dim). The layout before the call (``dit/ulysses_to_heads``' ``dims``) and after it
(``dit/ulysses_to_sequence``' ``dims``) differ; each is a stated var, checked against the anchored call at regen and
against the tensors at the SP forward, and the real class under SP=2 (Ulysses, and a ring of 2) equals one process.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
CALL = (
    "dispatch_attention_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), "
    "attn_mask=attention_mask, dropout_p=0.0, is_causal=False)"
)
SPEC = f"""module = "diffusers.models.transformers.transformer_cosmos"
output = "generated/cosmos_dit/transformer_cosmos.py"
keep = ["CosmosAttnProcessor2_0"]

[[patch]]
template = "core/add_parameter"
scope = "CosmosAttnProcessor2_0.__call__"
vars = {{ name = "dit_sp" }}
why = "the processor takes the split"

[[patch]]
template = "dit/ulysses_to_heads"
scope = "CosmosAttnProcessor2_0.__call__"
before = "hidden_states = {CALL}"
vars = {{ tensors = ["query", "key", "value"], carrier = "dit_sp", replicated = "none", dims = "bhsd" }}
why = "query/key/value are (b, h, s, d) here: the call transposes them inline"

[[patch]]
template = "dit/ulysses_to_sequence"
scope = "CosmosAttnProcessor2_0.__call__"
after = "hidden_states = {CALL}"
vars = {{ tensor = "hidden_states", dims = "bshd" }}
why = "dispatch_attention_fn returns (b, s, h, d)"

[[patch]]
template = "dit/ring_attention"
scope = "CosmosAttnProcessor2_0.__call__"
anchor = "{CALL}"
vars = {{ callee = "dispatch_attention_fn" }}
why = "under a ring: ring attention with the call's own arguments"
"""


def _generate(tmp: Path, spec: str) -> Path:
    for name in ("pyproject.toml", "templates"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, tmp / name)
    (tmp / "specs").mkdir()
    (tmp / "specs" / "cosmos.toml").write_text(spec)
    config = load_config(tmp)
    regen(config, load_specs(config, None))
    return tmp / "generated" / "cosmos_dit" / "transformer_cosmos.py"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ('replicated = "none", dims = "bhsd"', 'replicated = "none", dims = "bshd"'),
            "patch 2 (dit/ulysses_to_heads) in scope 'CosmosAttnProcessor2_0.__call__': vars.dims = 'bshd' says "
            "query is (batch, seq, heads, dim), but the attention call it is anchored beside passes "
            "`query.transpose(1, 2)` to dispatch_attention_fn, which takes (batch, seq, heads, dim): query is "
            "(batch, heads, seq, dim) here; state dims = 'bhsd'",
        ),
        (
            ('tensor = "hidden_states", dims = "bshd"', 'tensor = "hidden_states"'),
            "patch 3 (dit/ulysses_to_sequence) in scope 'CosmosAttnProcessor2_0.__call__': vars.dims = 'same' (the "
            "layout the tensors had before the call), but the call transposes them inline: they are (batch, heads, "
            "seq, dim) before it and its result hidden_states is (batch, seq, heads, dim); state dims = 'bshd'",
        ),
    ],
    ids=["heads", "sequence"],
)
def test_a_layout_the_anchored_call_contradicts_is_refused_at_regen(tmp_path: Path, edit, expected) -> None:
    assert edit[0] in SPEC
    with pytest.raises(PatchgenError) as caught:
        _generate(tmp_path, SPEC.replace(*edit))
    message = str(caught.value)
    assert "\n" not in message and expected in message, message
    assert not (tmp_path / "generated").exists()


def _sp_run(rank: int, world_size: int, path: str, ring: int) -> dict:
    import torch
    from diffusers.models.attention_processor import Attention

    from runtime.diffusion.sp import attention_split, shard_tokens, token_shard, ulysses_to_heads, ulysses_to_sequence
    from runtime.parallel.collectives import gather_along_dim, unpad
    from runtime.parallel.state import init_parallel_state

    spec = importlib.util.spec_from_file_location(f"scratch_cosmos_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    attn = Attention(32, heads=4, dim_head=8, qk_norm="rms_norm", processor=module.CosmosAttnProcessor2_0())
    x = torch.randn(2, 9, 32)  # 9 tokens: sp = 2 pads one
    expected = attn(x)
    init_parallel_state(sp_size=world_size, ring_size=ring)
    shard = token_shard(attn, 9, (module.CosmosAttnProcessor2_0,))
    out = attn(shard_tokens(x, shard), dit_sp=shard)
    got = unpad(gather_along_dim(out.detach(), 1, shard.group), 1, shard.pad)
    errors = []
    if ring == 1:  # the run-time check of a statement regen could not see (called directly)
        split = attention_split(shard, replicated="none", dims="bshd", site="heads site", module=attn)
        q = torch.randn(2, 4, 5, 8)  # (b, h, s, d): this rank's 5 tokens, 4 heads; stated bshd
        out = torch.randn(2, 9, 2, 8)  # (b, s, h, d): every token, this rank's 2 heads; stated bhsd
        for call in (lambda: ulysses_to_heads(split, q, q, q), lambda: ulysses_to_sequence(split, out, dims="bhsd")):
            try:
                call()
                errors.append("no error")
            except ValueError as exc:
                errors.append(str(exc))
    return {"max": float((got - expected).abs().max()), "scale": float(expected.abs().max()), "errors": errors}


@pytest.mark.dist
@pytest.mark.parametrize("ring", [1, 2], ids=["ulysses2", "ring2"])
def test_the_real_class_under_sp_equals_one_process(tmp_path: Path, ring: int) -> None:
    path = _generate(tmp_path, SPEC)
    text = path.read_text()
    assert 'hidden_states = ulysses_to_sequence(dit_attn, hidden_states, dims="bshd")' in text
    for result in run_distributed(_sp_run, 2, str(path), ring, timeout=300):
        # float32, 8-dim heads, 9 keys: one process and SP sum the same terms in another order
        assert result["max"] <= 1e-6 * max(result["scale"], 1.0), result
        for message in result["errors"]:
            assert message.startswith("heads site: "), message
            assert "does not match the stated dims" in message and "state the dims the code has" in message, message
