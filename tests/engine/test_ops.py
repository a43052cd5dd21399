"""Every operation against the fixture upstream: exact generated code, markers, imports, absolutized imports,
pruning, exclude and rename."""

from __future__ import annotations

import pytest

from patchgen.errors import PatchgenError
from tests.engine.helpers import ALL_OPS, TOY, FixtureSource, body_of, make_project, spec_toml, upstream_text

UPSTREAM = upstream_text(TOY)


@pytest.fixture(scope="module")
def all_ops(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("all_ops"), spec_toml(patches=ALL_OPS)).generate()


def generate_one(project, **patch):
    """The toy spec with this one patch, generated."""
    return project(spec_toml(patches=[patch])).generate()


def test_insert_after_with_every_var_type(all_ops) -> None:
    assert (
        "        residual = hidden\n"
        "        # patchgen #1 fx/insert_trace (2 stmt): trace the residual\n"
        '        logger = logging.getLogger("toy")\n'
        '        trace_event(logger, level=3, enabled=False, tags=["a", "b"], ratio=0.25, dims=[1, 2])\n'
        "        # patchgen #2 fx/replace_rescale (2 stmt): scale more\n"
        "        hidden = rescale(hidden, factor=self.config.scale * 2.0)\n"
        "        hidden = checkpoint(hidden)\n"
        "        if attention_mask is not None:\n"
        "            # mask out padded positions\n"
    ) in all_ops.text


def test_var_defaults_are_used(project) -> None:
    patch = dict(
        template="fx/insert_trace",
        scope="ToyLayer.forward",
        before="residual = hidden",
        vars=dict(name="d"),
        why="defaults",
    )
    gen = project(spec_toml(patches=[patch])).generate()
    assert (
        "        # patchgen #1 fx/insert_trace (2 stmt): defaults\n"
        '        logger = logging.getLogger("d")\n'
        "        trace_event(logger, level=1, enabled=True, tags=[], ratio=0.5, dims=[0])\n"
        "        residual = hidden\n"
    ) in gen.text


def test_insert_before_compound_header(all_ops) -> None:
    assert (
        "        loss = None\n"
        "        # patchgen #8 fx/insert_code (1 stmt): anchored on a compound header\n"
        "        labels = list(labels) if labels else labels\n"
        "        if labels is not None:\n"
    ) in all_ops.text


def test_wrap_uses_expr_and_scope_and_marks_the_statement(all_ops) -> None:
    assert (
        "        if labels is not None:\n"
        "            # patchgen #3 fx/wrap_guard (1 stmt): guard the loss\n"
        '            loss = guard(self.loss_function, scope="ToyForTask.forward")(out, labels)\n'
    ) in all_ops.text


def test_add_method_appends_to_the_class(all_ops) -> None:
    assert (
        "        return lazy_helper()\n"
        "\n"
        "    # patchgen #4 fx/add_method (1 stmt): a new method\n"
        "    def double_depth(self):\n"
        '        """Added by a fixture template."""\n'
        "        return self.depth * 2\n"
        "\n"
        "\n"
        "class ToyForTask(ToyModel):\n"
    ) in all_ops.text


def test_replace_method_keeps_leading_blank_line_and_decorators(all_ops) -> None:
    assert (
        "        self.ToyLayer = ToyLayer  # an attribute that happens to share the class name\n"
        "\n"
        "    # patchgen #5 fx/replace_method (1 stmt): constant mask\n"
        "    @staticmethod\n"
        "    def default_mask(length):\n"
        "        return [0.5] * length\n"
        "\n"
        "    @property\n"
    ) in all_ops.text


def test_add_definition_appends_to_the_module_and_is_kept(all_ops) -> None:
    assert all_ops.text.endswith(
        '__all__ = ["ToyConfig", "ToyModel", "ToyForTask"]\n'
        "\n"
        "\n"
        "# patchgen #6 fx/add_definition (1 stmt): a helper\n"
        "def bounded(x):\n"
        "    return clamp(x, -1.0, 1.0)\n"
    )


def test_add_definition_after_an_anchor(project) -> None:
    gen = generate_one(
        project,
        template="fx/add_definition",
        scope="<module>",
        after="EPS = 1e-6",
        vars=dict(name="lo", low=0.0, high=2.0),
        why="placed",
    )
    assert (
        "EPS   =   1e-6  # odd spacing kept verbatim\n"
        "# patchgen #1 fx/add_definition (1 stmt): placed\n"
        "def lo(x):\n"
        "    return clamp(x, 0.0, 2.0)\n"
    ) in gen.text


def test_replace_definition(all_ops) -> None:
    assert (
        "\n\n# patchgen #7 fx/replace_definition (1 stmt): gain\n"
        "def rescale(x, factor=1.0):\n"
        "    return [v * factor * 3 for v in x]\n"
    ) in all_ops.text
    assert "return [v * factor for v in x]" not in all_ops.text


def test_imports_block_after_module_imports_in_patch_order_without_duplicates(all_ops) -> None:
    assert (
        "from fixturepkg.models.sibling import (\n"
        "    SiblingHelper,\n"
        "    sibling_scale,  # a comment inside a multi-line import\n"
        ")\n"
        "# patchgen imports (4 stmt): names the patches below use\n"
        "import logging\n"
        "from fixturepkg.extra import trace_event\n"
        "from fixturepkg.extra import checkpoint\n"
        "from fixturepkg.extra import guard\n"
        "\n"
        "try:\n"
    ) in all_ops.text
    assert all_ops.text.count("import logging") == 1


def test_no_imports_block_when_templates_import_nothing(project) -> None:
    gen = generate_one(
        project,
        template="fx/insert_code",
        scope="ToyModel.forward",
        after="norm = math.sqrt(sum(h * h for h in hidden) + EPS)",
        vars=dict(code="norm_default"),
        why="x",
    )
    assert "patchgen imports" not in gen.text


def test_header_lists_every_patch_with_its_why(all_ops) -> None:
    assert "#   #3 fx/wrap_guard @ ToyForTask.forward: guard the loss\n" in all_ops.text
    assert all_ops.text.index("# ---- end of patchgen provenance ----") < all_ops.text.index("# coding=utf-8")


def test_generated_module_compiles_and_every_marker_counts_its_statements(all_ops) -> None:
    compile(all_ops.text, "gen.py", "exec")
    markers = [line.strip() for line in all_ops.text.splitlines() if line.strip().startswith("# patchgen #")]
    assert [m.split()[2] for m in markers] == ["#7", "#1", "#2", "#5", "#4", "#8", "#3", "#6"]


def test_relative_imports_become_absolute(all_ops) -> None:
    assert "from fixturepkg.util import clamp, make_registry\n" in all_ops.text
    assert "from fixturepkg.models import sibling\n" in all_ops.text
    assert "from fixturepkg.models.sibling import (\n    SiblingHelper,\n" in all_ops.text
    assert "from ." not in all_ops.text


def test_function_level_relative_import_becomes_absolute_when_its_class_is_not_patched(project) -> None:
    gen = generate_one(
        project,
        template="fx/insert_code",
        scope="ToyLayer.forward",
        after="residual = hidden",
        vars=dict(code="nothing"),
        why="x",
    )
    assert (
        "        from fixturepkg.models.sibling import lazy_helper  # a function-level relative import\n" in gen.text
    )
    assert "from ." not in gen.text


def test_unpatched_spec_only_absolutizes_and_prunes(project) -> None:
    gen = project(spec_toml()).generate()
    assert "from ." not in gen.text
    assert "# patchgen #" not in gen.text


def test_pruning(all_ops) -> None:
    text = all_ops.text
    for pruned in ("class UnusedThing", "def unused_function", "def only_used_by_unused"):
        assert pruned not in text
    for kept in (
        "def traced(fn):",
        "def debug_dump(obj)",
        "class ToyConfig:",
        "class ToyLayer:",
        "class ToyModel:",
        "class ToyForTask(ToyModel):",
        "def rescale(",
        "def bounded(",
    ):
        assert kept in text
    # module-level try/if blocks and assignments stay verbatim
    for verbatim in (
        "try:\n    import json as _json\nexcept ImportError:  # pragma: no cover - json is stdlib\n    _json = None\n",
        'if os.environ.get("FIXTUREPKG_DEBUG"):  # a module-level compound statement\n'
        "    DEBUG_HOOK = debug_dump\nelse:\n    DEBUG_HOOK = None\n",
        "_REGISTRY = make_registry()\nEPS   =   1e-6  # odd spacing kept verbatim\n",
    ):
        assert verbatim in text
    assert '__all__ = ["ToyConfig", "ToyModel", "ToyForTask"]\n' in text


def test_pruning_follows_keep_roots(project) -> None:
    text = project(spec_toml(keep=["ToyConfig"])).generate().text
    assert "class ToyConfig:" in text and "class ToyModel" not in text and "class ToyLayer" not in text
    assert "def traced(fn):" not in text  # only the pruned layer used it
    assert "def debug_dump(obj)" in text  # the module-level `if` still uses it
    assert '__all__ = ["ToyConfig"]\n' in text


def test_keep_root_keeps_unreachable_definition(project) -> None:
    text = project(spec_toml(keep=["ToyForTask", "unused_function"])).generate().text
    assert "def unused_function():" in text and "class UnusedThing:" in text and "def only_used_by_unused" in text
    assert '"UnusedThing", "unused_function"]' in text


def test_exclude_with_a_remaining_reference_is_an_error_naming_the_reference(project) -> None:
    proj = project(spec_toml(exclude=["ToyLayer"]))
    with pytest.raises(PatchgenError) as err:
        proj.generate()
    message = str(err.value)
    assert str(proj.root / "specs" / "toy.toml") in message
    assert "pruned or excluded" in message
    assert "ToyModel.__init__" in message and "ToyForTask.build_layer" in message and "'ToyLayer'" in message


def test_exclude_of_a_reference_patched_away_is_fine(project) -> None:
    gen = project(
        spec_toml(
            keep=["ToyForTask"],
            exclude=["traced"],
            patches=[
                dict(
                    template="fx/replace_code",
                    scope="ToyLayer",
                    anchor="def forward(self, hidden, attention_mask=None):",
                    vars=dict(code="forward_def"),
                    why="drop the traced forward",
                )
            ],
        )
    ).generate()
    assert "def traced" not in gen.text and "@traced" not in gen.text


def test_an_excluded_definition_keeps_nothing_alive(project) -> None:
    """Excluding a definition whose only reference a patch removes also prunes what only it used."""
    upstream = upstream_text(TOY).replace(
        "    def default_mask(length):\n        return [1.0] * length\n",
        "    def default_mask(length):\n        unused_function()\n        return [1.0] * length\n",
    )
    assert "unused_function()\n        return [1.0]" in upstream
    replace = dict(
        template="fx/replace_method", scope="ToyModel.default_mask", removes=["unused_function()"], why="no more"
    )
    proj = project(spec_toml(exclude=["unused_function"], patches=[replace]))
    text = proj.generate(source=FixtureSource(overrides={TOY: upstream})).text
    assert "def unused_function" not in text and "unused_function()" not in text
    assert "class UnusedThing" not in text and "def only_used_by_unused" not in text  # reached only through it


def test_rename_changes_definition_and_references_but_not_attributes_or_keywords(project) -> None:
    gen = project(
        spec_toml(patches=[dict(template="core/rename", scope="ToyLayer", vars=dict(to="SPToyLayer"), why="SP layer")])
    ).generate()
    text = body_of(gen.text)
    assert "# patchgen #1 core/rename (1 stmt): SP layer\nclass SPToyLayer:\n" in text
    assert "self.layers = [SPToyLayer(config, i) for i in range(config.num_layers)]\n" in text
    assert "self.ToyLayer = SPToyLayer  # an attribute that happens to share the class name\n" in text
    assert "return sibling.build(ToyLayer=SPToyLayer, config=self.config)\n" in text
    assert "class ToyLayer" not in text and "ToyLayer(" not in text.replace("SPToyLayer(", "")
    compile(text, "gen.py", "exec")


def test_rename_of_an_exported_definition_updates_all(project) -> None:
    gen = project(
        spec_toml(
            patches=[dict(template="core/rename", scope="ToyForTask", vars=dict(to="SPToyForTask"), why="SP head")]
        )
    ).generate()
    assert "class SPToyForTask(ToyModel):" in gen.text
    assert '__all__ = ["ToyConfig", "ToyModel", "SPToyForTask"]\n' in gen.text


def test_template_imports_do_not_duplicate_existing_imports(project) -> None:
    proj = project(
        spec_toml(
            patches=[
                dict(
                    template="fx/insert_trace",
                    scope="ToyLayer.forward",
                    after="residual = hidden",
                    vars=dict(name="n"),
                    why="x",
                )
            ]
        )
    )
    src = UPSTREAM.replace("import math\n", "import math\nimport logging\n")
    text = proj.generate(source=FixtureSource(overrides={TOY: src})).text
    assert text.count("import logging\n") == 1
    assert (
        "# patchgen imports (1 stmt): names the patches below use\nfrom fixturepkg.extra import trace_event\n"
    ) in text


def test_try_header_is_an_anchor(project) -> None:
    src = UPSTREAM.replace(
        "        residual = hidden\n",
        "        residual = hidden\n        try:\n            pass\n        except ValueError:\n            pass\n",
    )
    gen = project(
        spec_toml(
            patches=[
                dict(
                    template="fx/insert_code",
                    scope="ToyLayer.forward",
                    before="try:",
                    vars=dict(code="snippet_0"),
                    why="before a try",
                )
            ]
        )
    ).generate(source=FixtureSource(overrides={TOY: src}))
    assert (
        "        residual = hidden\n"
        "        # patchgen #1 fx/insert_code (1 stmt): before a try\n"
        "        probe = 1\n"
        "        try:\n"
    ) in gen.text


def test_comments_in_a_template_body_survive(project) -> None:
    gen = generate_one(
        project,
        template="fx/insert_code",
        scope="ToyLayer.forward",
        after="residual = hidden",
        vars=dict(code="commented"),
        why="c",
    )
    assert (
        "        residual = hidden\n"
        "        # patchgen #1 fx/insert_code (2 stmt): c\n"
        "        # leading comment\n"
        "        w = 2  # trailing comment\n"
        "        # comment between\n"
        "        v = 3\n"
    ) in gen.text


def test_no_trailing_whitespace_in_lines_the_engine_writes(project) -> None:
    gen = project(spec_toml(patches=ALL_OPS)).generate()
    assert [line for line in gen.text.splitlines() if line != line.rstrip()] == []


def test_replace_a_run_of_statements_anchor_through(project) -> None:
    gen = generate_one(
        project,
        template="fx/replace_code",
        scope="ToyLayer.forward",
        anchor="residual = hidden",
        through="hidden = rescale(hidden, factor=self.config.scale)",
        vars=dict(code="one_for_two"),
        why="run",
    )
    assert (
        "    def forward(self, hidden, attention_mask=None):\n"
        "        # patchgen #1 fx/replace_code (1 stmt): run\n"
        "        # one statement for two\n"
        "        residual = hidden = rescale(hidden)\n"
        "        if attention_mask is not None:\n"
    ) in gen.text
    assert "factor=self.config.scale)" not in gen.text


def test_replace_a_run_through_the_end_of_a_block(project) -> None:
    gen = generate_one(
        project,
        template="fx/replace_code",
        scope="ToyLayer.forward",
        anchor="hidden = rescale(hidden, factor=self.config.scale)",
        through="return hidden",
        vars=dict(code="return_rescaled"),
        why="tail",
    )
    assert (
        "        residual = hidden\n"
        "        # patchgen #1 fx/replace_code (1 stmt): tail\n"
        "        return rescale(hidden)\n"
        "\n"
        "\n"
        "class ToyModel:\n"
    ) in gen.text


@pytest.mark.parametrize("key, anchor", [("after", "EPS = 1e-6"), ("anchor", "_REGISTRY = make_registry()")])
def test_definitions_a_patch_writes_at_top_level_are_not_pruned(project, key, anchor) -> None:
    template = "fx/insert_code" if key == "after" else "fx/replace_code"
    patch = dict(
        template=template,
        scope="<module>",
        **{key: anchor},
        vars=dict(code="helper_def"),
        why="module def",
    )
    gen = project(spec_toml(patches=[patch])).generate()
    assert f"# patchgen #1 {template} (1 stmt): module def\ndef helper():\n    return 1\n" in gen.text


def test_checked_in_code_templates_match_the_snippet_table() -> None:
    from tests.engine.helpers import FIXTURE_TEMPLATES
    from tests.engine.snippets import code_template

    for op in ("insert", "replace"):
        assert (FIXTURE_TEMPLATES / "fx" / f"{op}_code.py.j2").read_text(encoding="utf-8") == code_template(op)
