"""Every user-error path: the message names the spec file, the patch index and template, and what was
expected and found (and, for anchors and scopes, the nearest candidates with their upstream line numbers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from patchgen.errors import PatchgenError
from patchgen.project import regen
from patchgen.upstream import PinnedSource
from tests.engine.helpers import TOY, FixtureSource, spec_toml, upstream_line, upstream_text

INSERT = dict(
    template="fx/insert_code", scope="ToyLayer.forward", after="residual = hidden", vars=dict(code="nothing"), why="x"
)


def load_error(project, text: str) -> tuple[str, str]:
    proj = project(text)
    with pytest.raises(PatchgenError) as err:
        proj.spec()
    return str(err.value), str(proj.root / "specs" / "toy.toml")


def generate_error(project, patches: list[dict], **extra) -> tuple[str, str]:
    proj = project(spec_toml(patches=patches, **extra))
    with pytest.raises(PatchgenError) as err:
        proj.generate()
    return str(err.value), str(proj.root / "specs" / "toy.toml")


def candidates(message: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^ {4}line (\d+): (.*)$", message, re.M)]


# ---- spec loading -------------------------------------------------------------------------------------------


def test_unknown_key(project) -> None:
    message, path = load_error(project, spec_toml(modul="x"))
    assert (
        message == f"{path}: top level: unknown key 'modul'; expected one of ['class_prefix', 'companion', "
        f"'exclude', 'extends', 'keep', 'model', 'module', 'output', 'patch', 'remove']"
    )
    message, path = load_error(project, spec_toml(patches=[INSERT, {**INSERT, "anchr": "y"}]))
    assert message.startswith(f"{path}: patch 2 (fx/insert_code): unknown key 'anchr'; expected one of [")
    listed = set(re.findall(r"'(\w+)'", message.split("expected one of")[1]))
    assert {"after", "anchor", "before", "scope", "template", "vars", "why"} <= listed


def test_missing_key(project) -> None:
    message, path = load_error(project, 'module = "fixturepkg.models.modeling_toy"\noutput = "generated/t.py"\n')
    assert message == f"{path}: top level: missing required key 'keep' (array)"
    patch = {k: v for k, v in INSERT.items() if k != "why"}
    message, path = load_error(project, spec_toml(patches=[INSERT, patch]))
    assert message == f"{path}: patch 2 (fx/insert_code): missing required key 'why' (string)"
    message, path = load_error(project, spec_toml(patches=[{k: v for k, v in INSERT.items() if k != "template"}]))
    assert message == f"{path}: patch 1: missing required key 'template' (string)"


def test_wrong_type(project) -> None:
    message, path = load_error(project, spec_toml(keep="ToyForTask"))
    assert message.startswith(f"{path}: top level: key 'keep' must be a")
    assert message.endswith("array, found string 'ToyForTask'")
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "scope": 3}]))
    assert message == f"{path}: patch 1 (fx/insert_code): key 'scope' must be a string, found integer 3"
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "vars": ["code"]}]))
    assert message.startswith(f"{path}: patch 1 (fx/insert_code): key 'vars' must be a table, found array")


def test_unknown_template_lists_available(project) -> None:
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "template": "fx/insert_cod"}]))
    assert message.startswith(f"{path}: patch 1 (fx/insert_cod): unknown template 'fx/insert_cod'")
    available = message.split("available: ", 1)[1].split(", ")
    assert "core/rename" in available and available == sorted(available)  # the fixture project has templates/core
    assert "fx/add_definition, fx/add_method, fx/bad_syntax, fx/insert_code," in message


def test_undeclared_var(project) -> None:
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "vars": dict(code="nothing", color="red")}]))
    assert message == (
        f"{path}: patch 1 (fx/insert_code): vars.color is not declared by template fx/insert_code (declared: code)"
    )


def test_missing_required_var(project) -> None:
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "vars": {}}]))
    assert message.startswith(
        f"{path}: patch 1 (fx/insert_code): template fx/insert_code needs vars ['code']: code (word of "
        f"['nothing', 'probe', "
    )
    # a template whose every var is required, and no vars table at all
    rename = dict(template="core/rename", scope="ToyLayer", why="x")
    message, path = load_error(project, spec_toml(patches=[rename]))
    assert message.startswith(f"{path}: patch 1 (core/rename): template core/rename needs vars ['to']")


@pytest.mark.parametrize(
    "value, found",
    [
        ("3", "string '3'"),
        (True, "boolean True"),  # TOML true is not an int
        (1.5, "float 1.5"),
    ],
)
def test_wrong_var_type(project, value, found) -> None:
    patch = {**INSERT, "template": "fx/insert_trace", "vars": dict(name="n", level=value)}
    message, path = load_error(project, spec_toml(patches=[patch]))
    assert message == f"{path}: patch 1 (fx/insert_trace): vars.level must be an integer, found {found}"


def test_wrong_list_item_type(project) -> None:
    patch = {**INSERT, "template": "fx/insert_trace", "vars": dict(name="n", tags=["a", 1])}
    message, path = load_error(project, spec_toml(patches=[patch]))
    assert message == (
        f"{path}: patch 1 (fx/insert_trace): vars.tags must be an array whose every item is a string (rendered as "
        f"a quoted literal), found integer 1 (item 1 of array ['a', 1])"
    )


def test_wrong_anchor_keys_for_the_op(project) -> None:
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "before": "residual = hidden"}]))
    assert message == (
        f"{path}: patch 1 (fx/insert_code): op 'insert' takes exactly one of 'before' or 'after'; "
        f"found ['before', 'after']"
    )
    wrap = dict(template="fx/wrap_guard", scope="ToyModel.forward", after="x", why="x")
    message, path = load_error(project, spec_toml(patches=[wrap]))
    assert (
        message == f"{path}: patch 1 (fx/wrap_guard): op 'wrap' takes 'anchor' (the expression to wrap); "
        f"found ['after']"
    )


def test_bad_toml(project) -> None:
    message, path = load_error(project, 'module = "unterminated\n')
    assert message.startswith(f"{path}: not valid TOML: ")
    assert "line 1" in message


# ---- anchors and scopes -------------------------------------------------------------------------------------


def test_anchor_miss_lists_nearest_candidates_with_upstream_lines(project) -> None:
    anchor = "hidden = rescale(hidden, factor=self.config.scal)"
    message, path = generate_error(project, [INSERT, {**INSERT, "after": anchor}])
    assert message.startswith(
        f"{path}: patch 2 (fx/insert_code) in scope 'ToyLayer.forward': anchor {anchor!r} "
        f"matches no statement in scope 'ToyLayer.forward'"
    )
    assert "nearest candidates in fixturepkg==1.2.3 fixturepkg/models/modeling_toy.py:" in message
    found = candidates(message)
    assert found[0] == (
        upstream_line(TOY, "hidden = rescale(hidden,"),
        "hidden = rescale(hidden, factor=self.config.scale)",
    )
    assert len(found) == 3
    for line, text in found[1:]:  # the other candidates are one-liners: find them by text
        assert line == upstream_line(TOY, text)


def test_expression_anchor_miss_lists_candidates(project) -> None:
    wrap = dict(template="fx/wrap_guard", scope="ToyModel.forward", anchor="self.default_mask(len(hiden))", why="x")
    message, path = generate_error(project, [wrap])
    assert message.startswith(
        f"{path}: patch 1 (fx/wrap_guard) in scope 'ToyModel.forward': anchor "
        f"'self.default_mask(len(hiden))' matches no expression"
    )
    assert candidates(message)[0] == (
        upstream_line(TOY, "self.default_mask(len(hidden))"),
        "self.default_mask(len(hidden))",
    )


def test_ambiguous_anchor_lists_every_match(project) -> None:
    message, path = generate_error(project, [{**INSERT, "scope": "<module>", "after": "self.config = config"}])
    assert message.startswith(
        f"{path}: patch 1 (fx/insert_code) in scope '<module>': anchor 'self.config = config' "
        f"matches 2 statements in scope '<module>'"
    )
    lines = [
        no
        for no, line in enumerate(upstream_text(TOY).splitlines(), start=1)
        if line.strip() == "self.config = config"
    ]
    assert candidates(message) == [(n, "self.config = config") for n in lines]
    assert len(lines) == 2


def test_compound_header_without_colon_does_not_match(project) -> None:
    message, path = generate_error(project, [{**INSERT, "after": "if attention_mask is not None"}])
    assert f"{path}: patch 1 (fx/insert_code) in scope 'ToyLayer.forward'" in message
    assert "is not a Python statement" in message


def test_scope_missing_lists_nearest_scopes(project) -> None:
    message, path = generate_error(project, [{**INSERT, "scope": "ToyModle.forward"}])
    assert message.startswith(
        f"{path}: patch 1 (fx/insert_code) in scope 'ToyModle.forward': scope "
        f"'ToyModle.forward': no definition named 'ToyModle' in the module"
    )
    found = dict((text, line) for line, text in candidates(message))
    assert found["ToyModel"] == upstream_line(TOY, "class ToyModel:")
    assert found["ToyLayer"] == upstream_line(TOY, "class ToyLayer:")
    message, path = generate_error(project, [{**INSERT, "scope": "ToyModel.forwrd"}])
    assert "no definition named 'forwrd' in ToyModel" in message
    assert candidates(message) == [
        (upstream_line(TOY, "def forward(self, hidden, attention_mask: Optional"), "ToyModel.forward")
    ]


def test_wrap_anchor_that_is_not_an_expression(project) -> None:
    wrap = dict(template="fx/wrap_guard", scope="ToyModel.forward", anchor="attention_mask = None", why="x")
    message, path = generate_error(project, [wrap])
    assert message.startswith(
        f"{path}: patch 1 (fx/wrap_guard) in scope 'ToyModel.forward': anchor "
        f"'attention_mask = None' is not a Python expression"
    )


def test_wrap_template_rendering_a_statement(project) -> None:
    wrap = dict(template="fx/wrap_not_expression", scope="ToyModel.forward", anchor="self.default_mask", why="x")
    message, path = generate_error(project, [wrap])
    assert message.startswith(
        f"{path}: patch 1 (fx/wrap_not_expression) in scope 'ToyModel.forward': rendered wrap "
        f"is not a Python expression: 'self.default_mask = 1'"
    )


def test_rendered_template_with_a_syntax_error(project) -> None:
    bad = dict(
        template="fx/bad_syntax",
        scope="ToyModel.forward",
        before="return [h / norm for h in hidden]",
        vars=dict(cond="ready"),
        why="x",
    )
    message, path = generate_error(project, [INSERT, bad])
    template = Path(path).parents[1] / "templates" / "fx" / "bad_syntax.py.j2"
    assert message == (
        f"{path}: patch 2 (fx/bad_syntax) in scope 'ToyModel.forward': template {template} renders invalid Python: "
        "line 1, column 9: expected ':' in 'if ready'; fix the template or the patch's vars, then run `patchgen "
        "regen` again"
    )


def test_add_method_clashing_with_an_existing_method(project) -> None:
    add = dict(template="fx/add_method", scope="ToyModel", vars=dict(name="forward"), why="x")
    message, path = generate_error(project, [add])
    assert message.startswith(
        f"{path}: patch 1 (fx/add_method) in scope 'ToyModel': ToyModel already defines "
        f"['forward']; use a replace_method template"
    )


def test_add_method_needs_a_class(project) -> None:
    add = dict(template="fx/add_method", scope="rescale", vars=dict(name="extra"), why="x")
    message, path = generate_error(project, [add])
    assert f"{path}: patch 1 (fx/add_method) in scope 'rescale': op add_method needs a class scope" in message


def test_replace_method_needs_a_method_scope(project) -> None:
    message, path = generate_error(project, [dict(template="fx/replace_method", scope="ToyModel", why="x")])
    assert (
        f"{path}: patch 1 (fx/replace_method) in scope 'ToyModel': op replace_method takes scope "
        f"'Class.method', found 'ToyModel'" in message
    )


@pytest.mark.parametrize(
    "patches, culprit, owner",
    [
        (
            [
                dict(
                    template="fx/replace_code",
                    scope="ToyLayer.forward",
                    anchor="if attention_mask is not None:",
                    vars=dict(code="nothing"),
                    why="x",
                ),
                dict(
                    template="fx/wrap_guard", scope="ToyLayer.forward", anchor="zip(hidden, attention_mask)", why="y"
                ),
            ],
            "patch 2 (fx/wrap_guard) in scope 'ToyLayer.forward'",
            "patch 1 (fx/replace_code)",
        ),
        (
            [
                dict(
                    template="fx/insert_code",
                    scope="ToyModel.default_mask",
                    before="return [1.0] * length",
                    vars=dict(code="nothing"),
                    why="y",
                ),
                dict(template="fx/replace_method", scope="ToyModel.default_mask", why="x"),
            ],
            "patch 1 (fx/insert_code) in scope 'ToyModel.default_mask'",
            "patch 2 (fx/replace_method)",
        ),
        (
            [
                dict(
                    template="fx/replace_code",
                    scope="ToyLayer.forward",
                    anchor="residual = hidden",
                    vars=dict(code="nothing"),
                    why="x",
                ),
                dict(
                    template="fx/replace_code",
                    scope="ToyLayer.forward",
                    anchor="residual = hidden",
                    vars=dict(code="residual_zero"),
                    why="y",
                ),
            ],
            "patch 2 (fx/replace_code) in scope 'ToyLayer.forward'",
            "patch 1 (fx/replace_code)",
        ),
    ],
)
def test_conflicting_patches(project, patches, culprit, owner) -> None:
    message, path = generate_error(project, patches)
    assert message.startswith(f"{path}: {culprit}: conflicts with {owner}, which replaces the code this patch edits")


RUN = dict(
    template="fx/replace_code",
    scope="ToyLayer.forward",
    anchor="residual = hidden",
    through="hidden = rescale(hidden, factor=self.config.scale)",
    vars=dict(code="nothing"),
    why="run",
)


@pytest.mark.parametrize(
    "anchor, through",
    [
        ("residual = hidden", "hidden = [h * m for h, m in zip(hidden, attention_mask)]"),  # another block
        ("hidden = rescale(hidden, factor=self.config.scale)", "residual = hidden"),  # wrong order
    ],
)
def test_replace_run_ends_among_the_statements_after_the_anchor(project, anchor, through) -> None:
    message, path = generate_error(project, [{**RUN, "anchor": anchor, "through": through}])
    assert message.startswith(f"{path}: patch 1 (fx/replace_code) in scope 'ToyLayer.forward': ")
    assert (
        f"'through' {through!r} matches no statement in scope 'ToyLayer.forward' after 'anchor' {anchor!r} "
        f"in the same block" in message
    )


def test_replace_run_conflicts_with_an_edit_inside_it(project) -> None:
    inside = dict(
        template="fx/insert_code",
        scope="ToyLayer.forward",
        after="hidden = rescale(hidden, factor=self.config.scale)",
        vars=dict(code="nothing"),
        why="x",
    )
    message, path = generate_error(project, [RUN, inside])
    assert message.startswith(
        f"{path}: patch 2 (fx/insert_code) in scope 'ToyLayer.forward': conflicts with patch 1 (fx/replace_code)"
    )


def test_through_needs_op_replace(project) -> None:
    message, path = load_error(project, spec_toml(patches=[{**INSERT, "through": "return hidden"}]))
    assert message == (
        f"{path}: patch 1 (fx/insert_code): 'through' (end of a replaced run of statements) needs op "
        f"'replace', template fx/insert_code has op 'insert'"
    )


@pytest.mark.parametrize("key", ["keep", "exclude"])
def test_keep_or_exclude_naming_a_nonexistent_definition(project, key) -> None:
    extra = {"keep": ["ToyForTask", "Nope"]} if key == "keep" else {"exclude": ["Nah"]}
    message, path = generate_error(project, [], **extra)
    missing = "['Nope']" if key == "keep" else "['Nah']"
    assert message == (
        f"{path}: {key} names {missing}, which fixturepkg/models/modeling_toy.py (fixturepkg==1.2.3) "
        f"does not define at top level"
    )


# ---- upstream versions ---------------------------------------------------------------------------------------


def test_installed_version_differs_from_pin(project) -> None:
    proj = project(spec_toml(patches=[INSERT]), pins={"fixturepkg": "1.0.0"})
    before = proj.snapshot()
    source = PinnedSource(proj.config.pins, FixtureSource(version="1.2.3"))
    with pytest.raises(PatchgenError) as err:
        regen(proj.config, [proj.spec()], source=source)
    message = str(err.value)
    assert "installed fixturepkg==1.2.3 but the pin is fixturepkg==1.0.0" in message
    assert "patchgen upgrade --to fixturepkg==1.2.3" in message
    assert proj.snapshot() == before


def test_pinned_source_passes_through_the_pinned_version() -> None:
    inner = FixtureSource()
    upstream = PinnedSource({"fixturepkg": "1.2.3"}, inner).read(TOY)
    assert upstream.pin == "fixturepkg==1.2.3" and inner.reads == [TOY]
    with pytest.raises(PatchgenError, match="no pin for upstream package 'fixturepkg'"):
        PinnedSource({"transformers": "5.14.1"}, inner).read(TOY)


def test_patch_inside_a_pruned_definition_is_an_error(project) -> None:
    patch = dict(
        template="fx/insert_code",
        scope="UnusedThing.run",
        before="return only_used_by_unused(1)",
        vars=dict(code="nothing"),
        why="edits code nothing keeps",
    )
    message, path = generate_error(project, [patch])
    assert message.startswith(f"{path}: patch 1 (fx/insert_code) edits UnusedThing.run, but UnusedThing is pruned")
