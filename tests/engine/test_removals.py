"""No silent deletion: a patch that replaces upstream statements accounts for every one it removes.

A loss template whose replaced region held an upstream logit softcap regenerated fine and trained the unsoftcapped
model with exit 0. Now each removed statement must be re-implemented by the template (`reimplements`) or named by the
spec as a deliberate removal (`removes`), and regen names every other one with its upstream line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from patchgen.errors import PatchgenError
from patchgen.templates import parse_template
from tests.engine.helpers import REPO, TOY, FixtureSource, spec_toml, upstream_line, upstream_text

LOSS_TEMPLATE = """{#
op = "replace"
doc = "The toy loss region through one expression (tests of removal accounting)."
reimplements = [
    "loss = None",
    "if labels is not None:",
    "loss = self.loss_function({{ out }}, labels)",
    { start = "loss = loss * self.config.scale", when_set = "scale" },
]

[vars.out]
kind = "expr"
default = "out"
doc = "what the loss reads"

[vars.scale]
kind = "expr"
default = "None"
doc = "a factor the loss is multiplied by"
#}
{% set factor = " * " ~ scale if scale != "None" else "" %}
loss = None if labels is None else self.loss_function({{ out }}, labels){{ factor }}
"""
LOSS = "loss = self.loss_function(out, labels)"
EXTRA = "loss = loss * self.config.scale"  # an upstream statement the region gains (a config-gated scale)
MORE = "loss = loss + 0.5"  # one no template variable re-implements


def loss_patch(**extra) -> dict:
    return dict(
        template="fx/replace_loss",
        scope="ToyForTask.forward",
        anchor="loss = None",
        through="if labels is not None:",
        why="one loss expression",
        **extra,
    )


def with_lines(*lines: str) -> FixtureSource:
    """The toy upstream with `lines` added to the `if labels is not None:` block, after the loss."""
    text = upstream_text(TOY)
    added = "".join(f"\n            {line}" for line in lines)
    assert text.count(f"            {LOSS}") == 1
    return FixtureSource(overrides={TOY: text.replace(f"            {LOSS}", f"            {LOSS}{added}")})


def loss_project(project, **extra):
    proj = project(spec_toml(patches=[loss_patch(**extra)]))
    (proj.root / "templates/fx/replace_loss.py.j2").write_text(LOSS_TEMPLATE)
    return proj


def test_every_removed_statement_the_template_reimplements_is_accepted(project) -> None:
    text = loss_project(project).generate().text
    assert "loss = None if labels is None else self.loss_function(out, labels)\n" in text
    assert "if labels is not None:" not in text


def test_an_extra_upstream_statement_in_the_replaced_region_is_refused_naming_its_line(project) -> None:
    source = with_lines(MORE)
    line = upstream_line(TOY, LOSS) + 1  # the added statement follows the loss
    assert source.overrides[TOY].splitlines()[line - 1].strip() == MORE
    with pytest.raises(PatchgenError) as err:
        loss_project(project).generate(source=source)
    [message] = str(err.value).splitlines()
    assert "specs/toy.toml: patch 1 (fx/replace_loss): replacing it deletes upstream" in message
    assert f"line {line} `{MORE}` in ToyForTask.forward" in message
    assert f'add removes = ["{MORE}"] to the patch' in message


def test_removes_accepts_a_deliberate_removal(project) -> None:
    text = loss_project(project, removes=[MORE]).generate(source=with_lines(MORE)).text
    assert MORE not in text


def test_one_line_per_unaccounted_statement_and_the_variable_that_would_keep_it(project) -> None:
    source = with_lines(EXTRA, MORE)
    with pytest.raises(PatchgenError) as err:
        loss_project(project).generate(source=source)
    first, second = str(err.value).splitlines()
    assert f"`{EXTRA}`" in first and "set vars.scale (a factor the loss is multiplied by)" in first
    assert f"`{MORE}`" in second and "removes" in second


def test_a_conditional_entry_counts_when_the_spec_sets_its_variable(project) -> None:
    proj = loss_project(project, vars=dict(scale="self.config.scale"), removes=[MORE])
    text = proj.generate(source=with_lines(EXTRA, MORE)).text
    assert "self.loss_function(out, labels) * self.config.scale\n" in text


def test_a_removes_entry_that_matches_nothing_is_refused(project) -> None:
    with pytest.raises(PatchgenError, match=r"removes entry 'loss = loss \+ 0.5' matches no statement"):
        loss_project(project, removes=[MORE]).generate()


def test_removes_on_a_patch_that_replaces_nothing_is_refused(project) -> None:
    patch = dict(
        template="fx/insert_code",
        scope="ToyForTask.forward",
        before="if labels is not None:",
        vars=dict(code="labels_list"),
        removes=["loss = None"],
        why="x",
    )
    with pytest.raises(PatchgenError, match=r"patch 1 \(fx/insert_code\): 'removes' names upstream statements"):
        project(spec_toml(patches=[patch])).spec()


@pytest.mark.parametrize(
    "entry, message",
    [
        ('reimplements = ["x ="]', "'reimplements' is for templates whose op replaces upstream code"),
        ('reimplements = [{ start = "x", when_set = "nope" }]', "when_set = 'nope' must name a declared variable"),
        ('reimplements = ["{{ nope }} ="]', "{{ nope }} must name a declared identifier"),
        ('reimplements = [""]', "reimplements[0] must be a statement start"),
    ],
)
def test_bad_reimplements_are_refused(entry: str, message: str) -> None:
    op = "insert" if "is for templates" in message else "replace"
    text = f'{{#\nop = "{op}"\ndoc = "d"\n{entry}\n#}}\nx = 1\n'
    with pytest.raises(PatchgenError, match=re.escape(message)):
        parse_template("fx/bad", Path("bad.py.j2"), text)


def test_no_shipped_template_accounts_for_everything() -> None:
    """The wildcard is for generic test templates whose code the spec picks; a shipped template names statements."""
    for path in sorted((REPO / "templates").rglob("*.py.j2")):
        assert '"*"' not in path.read_text().split("#}")[0], path


def test_a_placeholder_entry_reimplements_only_the_statement_of_the_patch_s_value(project) -> None:
    """`loss = self.loss_function({{ out }}, labels)`: with out = out[:1] the template computes another loss than
    upstream's `loss = self.loss_function(out, labels)`, which is then deleted, not re-implemented."""
    with pytest.raises(PatchgenError, match=re.escape(f"`{LOSS}` in ToyForTask.forward")):
        loss_project(project, vars=dict(out="out[ : 1]")).generate()
    text = loss_project(project, vars=dict(out="out[ : 1]"), removes=[LOSS]).generate().text
    assert "self.loss_function(out[:1], labels)\n" in text
