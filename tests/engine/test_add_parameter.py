"""Op `add_parameter` (template `core/add_parameter`): a function or method gains one keyword parameter with a default.

The generated functions are run (the plain fixture module imports nothing relative), so each signature is checked
by `inspect`, not by reading text back.
"""

from __future__ import annotations

import inspect

import pytest

from patchgen.errors import PatchgenError
from tests.engine.helpers import PLAIN, PROCESSORS, body_of, spec_toml


def add(scope: str, why: str = "a new parameter", **values) -> dict:
    return dict(template="core/add_parameter", scope=scope, vars=values, why=why)


def run(project, module: str, keep: list[str], patches: list[dict]) -> dict:
    """The generated module's namespace after executing it."""
    text = project(spec_toml(module, "generated/plain/m.py", keep, patches)).generate().text
    namespace: dict = {}
    exec(compile(text, "m.py", "exec"), namespace)
    return namespace


def test_a_plain_signature_gains_a_last_positional_or_keyword_parameter(project) -> None:
    namespace = run(project, PLAIN, ["Counter"], [add("Counter.add", name="scale", default="LIMIT * 2")])
    signature = inspect.signature(namespace["Counter"].add)
    assert list(signature.parameters) == ["self", "amount", "scale"]
    assert signature.parameters["scale"].default == 20
    assert signature.parameters["scale"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_after_a_bare_star_it_is_keyword_only(project) -> None:
    namespace = run(project, PLAIN, ["pairs"], [add("pairs", name="tag")])
    parameters = inspect.signature(namespace["pairs"]).parameters
    assert list(parameters) == ["items", "skip", "tag"]
    assert parameters["tag"].kind is inspect.Parameter.KEYWORD_ONLY and parameters["tag"].default is None
    assert namespace["pairs"]([1, 2, 3], tag="x") == [(1, 2), (2, 3), None]


def test_with_args_and_kwargs_it_goes_between_as_keyword_only(project) -> None:
    """Before `**kwargs`, and never positional: `proc(attn, hidden, extra)` still lands extra in *args."""
    proj = project(
        spec_toml(
            PROCESSORS, "generated/p/processors.py", ["ToyProcessor"], [add("ToyProcessor.__call__", name="boost")]
        )
    )
    body = body_of(proj.generate().text)
    assert (
        "    # patchgen #1 core/add_parameter (1 stmt): a new parameter\n"
        "    def __call__(self, attn: ToyAttention, hidden, *args, boost=None, **kwargs):\n"
    ) in body


def test_the_signature_keeps_its_layout_one_parameter_per_line(project) -> None:
    upstream = "def f(\n    a,\n    b=1,\n):\n    return a + b\n"
    from tests.engine.helpers import FixtureSource

    proj = project(spec_toml(PLAIN, "generated/plain/m.py", ["f"], [add("f", name="c", default="2")]))
    text = proj.generate(source=FixtureSource(overrides={PLAIN: upstream})).text
    assert body_of(text).endswith("def f(\n    a,\n    b=1,\n    c=2,\n):\n    return a + b\n")


def test_an_existing_name_is_a_conflict(project) -> None:
    for name in ("skip", "items"):
        proj = project(spec_toml(PLAIN, "generated/plain/m.py", ["pairs"], [add("pairs", name=name)]))
        with pytest.raises(PatchgenError, match=f"patch 1 .* pairs already has a parameter named '{name}'"):
            proj.generate()
    proj = project(
        spec_toml(PROCESSORS, "generated/p/p.py", ["ToyProcessor"], [add("ToyProcessor.__call__", name="kwargs")])
    )
    with pytest.raises(PatchgenError, match="already has a parameter named 'kwargs'"):
        proj.generate()


def test_the_scope_must_be_a_function(project) -> None:
    proj = project(spec_toml(PLAIN, "generated/plain/m.py", ["Counter"], [add("Counter", name="x")]))
    with pytest.raises(PatchgenError, match="op add_parameter needs a function or method scope, 'Counter' is not one"):
        proj.generate()


def test_it_conflicts_with_a_replacement_of_the_same_function(project) -> None:
    replace = dict(template="fx/replace_definition", scope="rescale", vars=dict(gain=3), why="replaced")
    proj = project(spec_toml(patches=[replace, add("rescale", name="extra")]))
    with pytest.raises(PatchgenError, match=r"patch 2 \(core/add_parameter\).*conflicts with patch 1"):
        proj.generate()
