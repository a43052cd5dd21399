"""Checked sites at generation time (the spec side of "never silently wrong"), on the shipped Wan spec in a temporary
project: a processor `dit/shard_tokens` accepts must have its Ulysses site, and every identifier var of the SP kinds
must name something at its patch's scope.

Before, a listed processor without a `dit/ulysses_to_heads` patch regenerated fine and, under SP, attended to its
rank's tokens only (wrong numbers, exit 0); a processor "class" that was a local of the forward also regenerated.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.generate import Generated, generate
from patchgen.spec_set import load_specs
from patchgen.upstream import PinnedSource
from tests.engine.helpers import REPO

SPEC = (REPO / "specs/wan.toml").read_text()
SHARD_VARS = 'vars = { tokens = ["hidden_states"], processors = ["WanAttnProcessor"] }'
HEADS_VARS = 'carrier = "rotary_emb", replicated = "none", dims = "bshd" }'
SEQUENCE_VARS = 'vars = { tensor = "hidden_states" }\nwhy = "and back'
RING_VARS = 'vars = { callee = "dispatch_attention_fn" }'


def wan(tmp_path: Path, *edits: tuple[str, str]) -> Generated:
    text = SPEC
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/wan.toml").write_text(text)
    config = load_config(tmp_path)
    [spec] = load_specs(config, ["wan"])
    return generate(spec, PinnedSource(config.pins), config)


def test_a_listed_processor_without_its_ulysses_site_is_refused(tmp_path: Path) -> None:
    listed = SHARD_VARS.replace('["WanAttnProcessor"]', '["WanAttnProcessor", "WanAttnProcessor2_0"]')
    with pytest.raises(PatchgenError) as err:
        wan(tmp_path, (SHARD_VARS, listed))
    [message] = str(err.value).splitlines()
    assert message.startswith(f"{tmp_path / 'specs/wan.toml'}: patch 1 (dit/shard_tokens): vars.processors lists ")
    assert "'WanAttnProcessor2_0', but no dit/ulysses_to_heads (or " in message  # or another attention site kind
    assert "patch has scope 'WanAttnProcessor2_0.__call__': under SP that processor would attend" in message
    assert message.endswith(
        "Add dit/ulysses_to_heads and dit/ulysses_to_sequence patches for WanAttnProcessor2_0.__call__, or drop "
        "WanAttnProcessor2_0 from processors"
    )


@pytest.mark.parametrize(
    "edit, var",
    [
        ((SHARD_VARS, SHARD_VARS.replace('["hidden_states"]', '["hidden_statez"]')), "tokens"),
        ((SHARD_VARS, SHARD_VARS.replace('["WanAttnProcessor"]', '["WanAttnProcesor"]')), "processors"),
        # a local of the patched forward is no processor class
        (
            (SHARD_VARS, SHARD_VARS.replace('["WanAttnProcessor"]', '["WanAttnProcessor", "hidden_states"]')),
            "processors",
        ),
        (('tensors = ["query", "key", "value"]', 'tensors = ["query", "key", "valu"]'), "tensors"),
        ((HEADS_VARS, HEADS_VARS.replace('"rotary_emb"', '"rotary"')), "carrier"),
        ((HEADS_VARS, HEADS_VARS.replace(" }", ', module = "attention" }')), "module"),
        ((SEQUENCE_VARS, SEQUENCE_VARS.replace(" }", ', state = "dit_split" }')), "state"),  # what no patch assigns
    ],
)
def test_an_identifier_naming_nothing_at_its_scope_is_refused(tmp_path: Path, edit: tuple[str, str], var: str) -> None:
    with pytest.raises(PatchgenError, match=f"vars.{var} = '\\w+' names no"):
        wan(tmp_path, edit)


def test_names_the_templates_assign_or_the_scope_binds_are_accepted(tmp_path: Path) -> None:
    state = 'state = "dit_split" }'
    text = wan(
        tmp_path,
        (HEADS_VARS, HEADS_VARS.replace(" }", f', module = "attn", {state}')),  # attn: the processor's parameter
        (SEQUENCE_VARS, SEQUENCE_VARS.replace(" }", f", {state}")),
        (RING_VARS, RING_VARS.replace(" }", f", {state}")),
    ).text
    assert "dit_split = attention_split(rotary_emb, " in text and ", module=attn)\n" in text
