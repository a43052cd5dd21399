"""Specs are data and templates are sandboxed (issue 11, items 2 and 3): no spec value can add a statement to a
generated file, no template can reach Python internals or files outside the templates directory."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from patchgen.errors import PatchgenError
from patchgen.templates import load_template
from tests.engine.helpers import REPO, body_of, spec_toml

CONVERSIONS = dict(template="core/upstream_weight_conversions", scope="<module>", why="x")
RENAME = dict(template="core/rename", scope="rescale", why="r")
INJECTIONS = [
    'x")\nimport os\nos.system("echo pwned")\n#',
    "x'); import os; ('",
    'x"""\nimport os\n"""',
    "x\\",
]


@pytest.mark.parametrize("value", INJECTIONS)
def test_a_str_var_renders_as_one_literal_whatever_it_holds(project, value) -> None:
    proj = project(spec_toml(patches=[{**CONVERSIONS, "vars": dict(model_type=value)}]))
    body = body_of(proj.generate().text)
    calls = [s for s in ast.parse(body).body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
    assert [ast.literal_eval(call.value.args[0]) for call in calls] == [value]  # the value itself, as a string
    assert "os.system" not in [ast.unparse(s) for s in ast.walk(ast.parse(body)) if isinstance(s, ast.Call)]


@pytest.mark.parametrize("value", ["x; import os", "x\nimport os", "import", "a.b", "", "x y"])
def test_an_identifier_var_refuses_anything_but_a_name(project, value) -> None:
    proj = project(spec_toml(patches=[{**RENAME, "vars": dict(to=value)}]))
    with pytest.raises(PatchgenError, match=r"patch 1 \(core/rename\): vars.to must be a Python name"):
        proj.spec()


@pytest.mark.parametrize("value", ["1\nimport os", "x = 1", "a; b", "lambda:", ""])
def test_an_expr_var_must_be_exactly_one_expression(project, value) -> None:
    proj = project(
        spec_toml(
            patches=[
                dict(
                    template="fx/bad_syntax",
                    scope="ToyLayer.forward",
                    after="residual = hidden",
                    vars=dict(cond=value),
                    why="x",
                )
            ]
        )
    )
    with pytest.raises(PatchgenError, match=r"vars.cond must be exactly one Python expression"):
        proj.spec()


def test_an_expr_var_renders_normalized_on_one_line(tmp_path: Path) -> None:
    template = _write_template(
        tmp_path, "t/wrap", 'op = "wrap"\ndoc = "d"\n[vars.e]\nkind = "expr"\ndoc = "e"', "f({{ expr }}, {{ e }})"
    )
    # a comment in the value would swallow the rest of the line; a line break could start a statement
    assert template.render({"e": "(a +  # c\n b)"}, {"expr": "x"}) == "f(x, a + b)\n"


@pytest.mark.parametrize("why", ["two\nlines", "carriage\rreturn", "tab\tinside", "   "])
def test_why_is_one_printable_line(project, why) -> None:
    proj = project(spec_toml(patches=[{**RENAME, "vars": dict(to="rescale2"), "why": why}]))
    with pytest.raises(PatchgenError, match=r"'why' must say in one line"):
        proj.spec()


@pytest.mark.parametrize("scope", ["Toy Layer", "ToyLayer.forward\nimport os", "a..b", "<modul>"])
def test_scope_is_a_dotted_path(project, scope) -> None:
    proj = project(spec_toml(patches=[{**RENAME, "scope": scope, "vars": dict(to="y")}]))
    with pytest.raises(PatchgenError, match=r"'scope' must be '<module>', a top-level name or a dotted path"):
        proj.spec()


def _write_template(root: Path, name: str, front: str, body: str):
    path = root / "templates" / f"{name}.py.j2"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{#\n" + front + "\n#}\n" + body + "\n", encoding="utf-8")
    return load_template(root / "templates", name)


@pytest.mark.parametrize(
    "body",
    [
        "{% set _ = lipsum.__globals__['os'].system('touch PWNED') %}x",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
        "{{ range.__self__ }}",
        "{{ expr.__class__ }}",
        "{% for c in ''.__class__.__base__.__subclasses__() %}{% endfor %}x",
    ],
)
def test_templates_render_in_a_sandbox(tmp_path: Path, monkeypatch, body: str) -> None:
    monkeypatch.chdir(tmp_path)
    template = _write_template(tmp_path, "evil/t", 'op = "wrap"\ndoc = "d"', body)
    with pytest.raises(PatchgenError, match="rendering failed"):
        template.render({}, {"expr": "x"})
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "fx/../../x", "fx\\x", "fx/x.py", "", "fx//x"])
def test_template_names_cannot_leave_the_templates_directory(project, name) -> None:
    proj = project(spec_toml(patches=[{**RENAME, "template": name, "vars": dict(to="y")}]))
    with pytest.raises(PatchgenError, match=r"must be family/kind"):
        proj.spec()


def test_a_template_symlinked_from_outside_is_refused(project, tmp_path: Path) -> None:
    outside = tmp_path / "outside.py.j2"
    outside.write_text((REPO / "templates" / "core" / "rename.py.j2").read_text(), encoding="utf-8")
    proj = project(spec_toml(patches=[{**RENAME, "template": "fx/linked", "vars": dict(to="y")}]))
    (proj.root / "templates" / "fx" / "linked.py.j2").symlink_to(outside)
    with pytest.raises(PatchgenError, match=r"outside the templates directory"):
        proj.spec()


def test_declared_var_kinds_are_checked_at_template_load(tmp_path: Path) -> None:
    cases = {
        'kind = "string"': "kind must be one of",
        'type = "str"': "'type' is now 'kind'",
        'kind = "word"': "needs choices",
        'kind = "word"\nchoices = ["a b"]': "needs choices",
        'kind = "int"\ndefault = "3"': "default must be an integer",
        'kind = "identifier"\ndefault = "x.y"': "default must be a Python name",
    }
    for index, (decl, message) in enumerate(cases.items()):
        with pytest.raises(PatchgenError, match=message):
            _write_template(tmp_path, f"k/t{index}", f'op = "insert"\ndoc = "d"\n[vars.v]\n{decl}\ndoc = "v"', "x = 1")
