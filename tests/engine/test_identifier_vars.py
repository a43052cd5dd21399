"""Identifier vars the rendered code reads must resolve in the generated module (issue 19, item 4).

Before, a name nothing defines (a typo, or a processor class the module never imports) regenerated without complaint
and raised NameError when the line ran.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.generate import generate
from patchgen.spec_set import load_specs
from patchgen.templates import parse_template
from patchgen.upstream import PinnedSource
from tests.engine.helpers import PROCESSORS, REPO, spec_toml

BOOST = dict(template="core/add_parameter", scope="ToyProcessor.__call__", vars=dict(name="boost"), why="a kwarg")


def scale(target: str = "scaled", factor: str = "boost") -> dict:
    return dict(
        template="fx/scale_by",
        scope="ToyProcessor.__call__",
        after="scaled = [h * _SCALE for h in hidden]",
        vars=dict(target=target, factor=factor),
        why="scale",
    )


def processors(project, patches: list[dict]):
    return project(spec_toml(PROCESSORS, "generated/p/processors.py", ["ToyProcessor"], patches)).generate()


def test_a_name_the_module_neither_defines_nor_imports_is_refused(project) -> None:
    proj = project(
        spec_toml(
            patches=[
                dict(
                    template="fx/wrap_guard",
                    scope="ToyForTask.forward",
                    anchor="self.loss_function",
                    vars=dict(fn="guardd"),
                    why="typo",
                )
            ]
        )
    )
    with pytest.raises(PatchgenError) as exc:
        proj.generate()
    assert str(exc.value) == (
        f"{proj.root / 'specs/toy.toml'}: patch 1 (fx/wrap_guard): vars.fn = 'guardd' names nothing "
        f"generated/toy/modeling_toy.py defines or imports, nor a parameter or local of ToyForTask.forward: the "
        f"generated code would raise NameError when it runs. Name a definition or import of the generated module (a "
        f"pruned definition: add it to 'keep'), or correct the name"
    )


@pytest.mark.parametrize(
    "factor",
    [
        "boost",  # a parameter another patch of the scope adds
        "kwargs",  # an upstream parameter
        "_SCALE",  # bound by a module-level statement the module keeps
        "hidden",  # an upstream parameter
        "len",  # a builtin
    ],
)
def test_names_the_scope_or_the_module_binds_resolve(project, factor: str) -> None:
    assert f"scaled = [v * {factor} for v in scaled]" in processors(project, [BOOST, scale(factor=factor)]).text


@pytest.mark.parametrize("factor", ["bost", "ToyAttentio", "residual"])
def test_names_bound_nowhere_are_refused(project, factor: str) -> None:
    with pytest.raises(PatchgenError, match=f"patch 2 \\(fx/scale_by\\): vars.factor = '{factor}' names nothing"):
        processors(project, [BOOST, scale(factor=factor)])


def test_a_name_the_template_reads_before_it_assigns_it_must_exist_already(project) -> None:
    """`fresh = [v * boost for v in fresh] ...` reads `fresh` first: its own assignment binds it too late."""
    with pytest.raises(PatchgenError, match="vars.target = 'fresh' names nothing"):
        processors(project, [BOOST, scale(target="fresh")])


def test_a_name_only_spelled_in_a_string_or_a_keyword_is_not_checked(project) -> None:
    label = dict(
        template="fx/label", scope="ToyProcessor.__call__", before="return scaled", vars=dict(label="nowhere")
    )
    text = processors(project, [{**label, "why": "a label"}]).text
    assert 'probe_label = dict(nowhere="nowhere")' in text


def test_a_name_the_template_declares_it_binds_is_not_checked(project, tmp_path) -> None:
    loop = dict(
        template="fx/loop_over",
        scope="ToyProcessor.__call__",
        before="return scaled",
        vars=dict(items="hidden", item="h2"),
    )
    assert "    for h2 in hidden:\n" in processors(project, [{**loop, "why": "loop"}]).text
    proj = project(spec_toml(PROCESSORS, "generated/p/processors.py", ["ToyProcessor"], [{**loop, "why": "loop"}]))
    template = proj.root / "templates/fx/loop_over.py.j2"
    template.write_text(template.read_text().replace("binds = true\n", ""))
    with pytest.raises(PatchgenError, match="vars.item = 'h2' names nothing"):  # read in its own `for` statement
        proj.generate()


def test_binds_is_for_identifier_vars_only() -> None:
    text = '{#\nop = "insert"\ndoc = "d"\n[vars.n]\nkind = "int"\nbinds = true\ndoc = "d"\n#}\nx = {{ n }}\n'
    with pytest.raises(PatchgenError, match="binds = true marks an identifier"):
        parse_template("fx/bad", Path("bad.py.j2"), text)


def test_the_reported_case_a_processor_the_module_never_imports(tmp_path) -> None:
    """HunyuanVideo's text refiner keeps upstream's AttnProcessor2_0; naming it in `processors` must not regenerate
    into a module that raises NameError at its first SP forward."""
    for name in ("pyproject.toml", "templates"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    (tmp_path / "specs").mkdir()
    spec = (REPO / "specs/hunyuanvideo.toml").read_text()
    wrong = spec.replace(
        'processors = ["HunyuanVideoAttnProcessor2_0"]',
        'processors = ["HunyuanVideoAttnProcessor2_0", "AttnProcessor2_0"]',
    )
    assert wrong != spec
    (tmp_path / "specs/hunyuanvideo.toml").write_text(wrong)
    config = load_config(tmp_path)
    [loaded] = load_specs(config, ["hunyuanvideo"])
    with pytest.raises(PatchgenError, match=r"\(dit/shard_tokens\): vars.processors = 'AttnProcessor2_0' names no"):
        generate(loaded, PinnedSource(config.pins), config)


def test_module_level_is_for_identifier_vars_only() -> None:
    text = '{#\nop = "insert"\ndoc = "d"\n[vars.n]\nkind = "int"\nmodule_level = true\ndoc = "d"\n#}\nx = {{ n }}\n'
    with pytest.raises(PatchgenError, match="module_level = true marks an identifier"):
        parse_template("fx/bad", Path("bad.py.j2"), text)
