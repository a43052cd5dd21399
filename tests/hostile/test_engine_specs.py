"""Hostile specs and templates (issue 25, item 5). Rule: a spec value that is unsafe, of the wrong type, or big enough
to exhaust the machine is refused when the spec loads, and a template that would build more than the sandbox allows
is refused while it renders: exit 2, one line naming the spec file and key (or the template file and the limit),
and nothing in the project changes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from patchgen.errors import PatchgenError
from patchgen.sandbox import MAX_OUTPUT_CHARS, MAX_STEPS, MAX_VALUE
from patchgen.templates import load_template
from patchgen.wheels import wheel_cache
from tests.engine.helpers import VERSION, build_wheel, make_project, run_cli, spec_toml

MODEL = """
[model]
model_type = "toy"
class = "ToyForTask"
upstream = "fixturepkg.AutoToy"
family = "causal_lm"

[model.tiny]
hidden_size = 8
rope_parameters = { rope_type = "default", rope_theta = 10000.0 }
"""
FROM = ("--from", f"fixturepkg=={VERSION}")


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(root: Path, capsys, *args: str) -> str:
    """Run the CLI; it must exit 2 with one line on stderr, print nothing else and change no file."""
    before = tree(root)
    code, out, err = run_cli(root, capsys, *args)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
    assert "Traceback" not in err and tree(root) == before
    return err


def with_tiny(extra: str) -> str:
    return spec_toml() + MODEL + extra + "\n"


SPEC_CASES = {
    "output with a newline": (spec_toml(output="generated/toy/modeling\ntoy.py"), "key 'output'"),
    "output with U+202E": (spec_toml(output="generated/toy/modeling_\u202eyot.py"), "key 'output'"),
    "output with an escape": (spec_toml(output="generated/toy/\x1b[31mmodeling.py"), "key 'output'"),
    "output not a module name": (spec_toml(output="generated/my-model/modeling.py"), "Python identifier"),
    "tiny: a string size": (spec_toml() + MODEL.replace("hidden_size = 8", 'hidden_size = "8"'), "'tiny.hidden_size'"),
    "tiny: a boolean size": (
        spec_toml() + MODEL.replace("hidden_size = 8", "hidden_size = true"),
        "'tiny.hidden_size'",
    ),
    "tiny: negative": (spec_toml() + MODEL.replace("hidden_size = 8", "hidden_size = -8"), "'tiny.hidden_size'"),
    "tiny: huge": (spec_toml() + MODEL.replace("hidden_size = 8", "hidden_size = 1000000000000"), "from 0 to 8192"),
    "tiny: NaN": (spec_toml() + MODEL.replace("10000.0", "nan"), "'tiny.rope_parameters.rope_theta'"),
    "tiny: infinite": (spec_toml() + MODEL.replace("10000.0", "inf"), "'tiny.rope_parameters.rope_theta'"),
    "tiny: a date": (with_tiny("released = 1979-05-27"), "'tiny.released'"),
    "tiny: a bidi string": (spec_toml() + MODEL.replace('"default"', '"def\u202eault"'), "rope_type"),
    "tiny: a long array": (with_tiny(f"layer_types = {['full'] * 300}".replace("'", '"')), "at most 256 items"),
    "tiny: nested too deep": (with_tiny("[model.tiny.a.b.c.d]\nx = 1"), "'tiny.a.b.c.d'"),
    "data: a huge string": (spec_toml() + MODEL + '[model.data]\nprocessor = "' + "P" * 5000 + '"\n', "'data."),
    "upstream = os.system": (spec_toml() + MODEL.replace("fixturepkg.AutoToy", "os.system"), "key 'upstream'"),
    "upstream = builtins.eval": (spec_toml() + MODEL.replace("fixturepkg.AutoToy", "builtins.eval"), "'upstream'"),
    "upstream private": (spec_toml() + MODEL.replace("AutoToy", "_private.AutoToy"), "key 'upstream'"),
    "a why of 400 characters": (
        spec_toml(patches=[dict(template="core/rename", scope="rescale", vars={"to": "r"}, why="w" * 400)]),
        "at most 300 characters",
    ),
    "300 keep roots": (spec_toml(keep=[f"Name{i}" for i in range(300)]), "at most 256"),
    "deeply nested TOML": (spec_toml() + "deep = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply"),
}


@pytest.mark.parametrize("case", SPEC_CASES)
def test_a_hostile_spec_value_is_refused_when_the_spec_loads(tmp_path, capsys, case) -> None:
    text, message = SPEC_CASES[case]
    proj = make_project(tmp_path / "proj", {"toy": text})
    err = refused(proj.root, capsys, "list")
    assert str(proj.root / "specs" / "toy.toml") in err and message in err, err


def test_a_spec_extending_a_huge_file_is_refused(tmp_path, capsys) -> None:
    base = spec_toml() + "# " + "x" * (2 << 20) + "\n"
    child = 'extends = "base"\nmodule = "fixturepkg.plain"\noutput = "generated/child/modeling_child.py"\n'
    proj = make_project(tmp_path / "proj", {"base": spec_toml(output="generated/base/m.py"), "child": child})
    proj.write_spec(base.replace("generated/toy/modeling_toy.py", "generated/base/m.py"), "base")
    err = refused(proj.root, capsys, "check", "child")
    assert f"{proj.root / 'specs' / 'base.toml'}: larger than 1024 KiB" in err


def test_a_spec_file_name_that_could_break_a_header_line_is_refused(tmp_path, capsys) -> None:
    proj = make_project(tmp_path / "proj", {"x\nimport os\n#": spec_toml()})
    err = refused(proj.root, capsys, "list")
    assert "spec file 'x\\nimport os\\n#.toml'" in err and "ASCII letters, digits, _ and -" in err


def test_a_model_class_that_is_not_kept_is_refused(tmp_path, capsys) -> None:
    """ToyModel is reachable from the keep root ToyForTask, but it is neither a root nor added by a patch."""
    proj = make_project(tmp_path / "proj", {"toy": spec_toml() + MODEL.replace('"ToyForTask"', '"ToyModel"')})
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert f"{proj.root / 'specs' / 'toy.toml'}: [model] class 'ToyModel'" in err and "'keep' root" in err


def _template(root: Path, body: str):
    path = root / "templates" / "evil" / "t.py.j2"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{#\nop = "insert"\ndoc = "d"\n#}\n' + body + "\n", encoding="utf-8")
    return load_template(root / "templates", "evil/t")


X = '"x"'
TEMPLATE_CASES = {
    "a 10**7-times string multiplication": ("x = {{ " + X + " * 10 ** 7 }}", f"{MAX_VALUE}"),
    "a 10**10-times string multiplication": ("x = {{ " + X + " * 10 ** 10 }}", f"{MAX_VALUE}"),
    "a huge power": ("x = {{ 7 ** 5000000 }}", f"{MAX_VALUE}"),
    "a huge output": ("{% for i in " + X + " * 50 %}{{ " + X + " * 900000 }}{% endfor %}", f"{MAX_OUTPUT_CHARS}"),
    "a huge captured block": (
        "{% set s %}{% for i in " + X + " * 50 %}{{ " + X + " * 900000 }}{% endfor %}{% endset %}{{ s|length }}",
        f"{MAX_OUTPUT_CHARS}",
    ),
    "doubling by concatenation": ("{% set s = " + X + " * 600000 %}{% set s = s ~ s %}{{ s|length }}", f"{MAX_VALUE}"),
    "nested loops": (
        "{% for a in " + X + " * 1500 %}{% for b in " + X + " * 1500 %}{% endfor %}{% endfor %}",
        f"{MAX_STEPS}",
    ),
    "exponential macro calls": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
        f"{MAX_STEPS}",
    ),
    "a wide center filter": ("x = {{ " + X + "|center(10000000) }}", "No filter named 'center'"),
    "a wide format method": ('x = {{ "{:>10000000}".format(1) }}', "str.format"),
    "a wide printf format": ('x = {{ "%10000000d" % 1 }}', "'%'"),
    "a huge join": ("{{ (" + X + " * 1000)|list|join(" + X + " * 20000) }}", f"{MAX_VALUE}"),
    "a huge replace": ("{{ (" + X + ' * 1000)|replace("x", ' + X + " * 20000) }}", f"{MAX_VALUE}"),
    "a division by zero": ("x = {{ 1 / 0 }}", "division by zero"),
}


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_a_template_fails_fast_at_a_named_limit(tmp_path, case) -> None:
    body, limit = TEMPLATE_CASES[case]
    started = time.perf_counter()
    with pytest.raises(PatchgenError) as error:  # when it loads (an unknown filter) or when it renders
        _template(tmp_path, body).render({})
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'templates' / 'evil' / 't.py.j2'}:") and limit in message, message
    assert "\n" not in message and time.perf_counter() - started < 10


def test_regen_with_a_template_over_a_limit_exits_2_with_one_line(tmp_path, capsys) -> None:
    proj = make_project(tmp_path / "proj")
    template = _template(proj.root, "x = {{ " + X + " * 10 ** 10 }}")
    patch = dict(template="evil/t", scope="ToyLayer.forward", after="residual = hidden", why="w")
    proj.write_spec(spec_toml(patches=[patch]))
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert f"{proj.root / 'specs' / 'toy.toml'}: patch 1 (evil/t)" in err and str(template.path) in err
    assert f"{MAX_VALUE}" in err
