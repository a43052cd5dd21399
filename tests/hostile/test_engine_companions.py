"""Hostile `[[companion]]` tables, scope qualifiers and `remove` lists (issue 19): refused when the spec loads (or, for
a companion output that is a symlink, before anything is written): exit 2, one line naming the spec, nothing changed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from patchgen.wheels import wheel_cache
from tests.engine.helpers import PROCESSORS, VERSION, build_wheel, joint_spec, make_project, run_cli

FROM = ("--from", f"fixturepkg=={VERSION}")


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(root: Path, capsys, *args: str) -> str:
    before = tree(root)
    code, out, err = run_cli(root, capsys, *args)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
    assert "Traceback" not in err and tree(root) == before
    return err


CASES = {
    "a path as the module": (
        joint_spec(companions=[("fixturepkg/../../etc/passwd", ["X"])]),
        "must be another module",
    ),
    "a module of another distribution": (joint_spec(companions=[("os.path", ["join"])]), "must be another module"),
    "a keep root that is no name": (joint_spec(companions=[(PROCESSORS, ["os.system('x')"])]), "keep"),
    "too many keep roots": (joint_spec(companions=[(PROCESSORS, [f"N{i}" for i in range(300)])]), "at most 256"),
    "too many companions": (
        joint_spec(companions=[(f"fixturepkg.m{i}", ["X"]) for i in range(17)]),
        "17 [[companion]] tables; at most 16 per spec",
    ),
    "a companion that is no table": (joint_spec(companions=[]) + "companion = [1]\n", "companion 1: must be a table"),
    "a qualifier with a space": (
        joint_spec([dict(template="core/add_parameter", scope="a b:X.f", vars=dict(name="x"), why="w")]),
        "'scope' must be",
    ),
    "remove without extends": ('remove = ["model.tiny.x"]\n' + joint_spec(), "needs 'extends'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_companion_or_qualifier_is_refused_when_the_spec_loads(tmp_path, capsys, case) -> None:
    text, message = CASES[case]
    proj = make_project(tmp_path / "p", text)
    build_wheel(wheel_cache(proj.root), VERSION)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert message in err and str(proj.root / "specs" / "toy.toml") in err


def test_a_huge_remove_list_is_refused(tmp_path, capsys) -> None:
    base = make_project(tmp_path / "p", joint_spec())
    base.write_spec(
        'extends = "toy"\nmodule = "x.y"\noutput = "generated/h/m.py"\nremove = ['
        + ", ".join(['"model.a"'] * 300)
        + "]\n",
        "heir",
    )
    err = refused(base.root, capsys, "list")
    assert "'remove' must be an array of at most 256 dotted keys" in err


def test_a_companion_output_that_is_a_symlink_out_of_the_generated_directory_is_refused(tmp_path, capsys) -> None:
    proj = make_project(tmp_path / "p", joint_spec())
    build_wheel(wheel_cache(proj.root), VERSION)
    outside = tmp_path / "outside.py"
    outside.write_text("precious\n")
    (proj.root / "generated" / "joint").mkdir(parents=True)
    (proj.root / "generated" / "joint" / "processors.py").symlink_to(outside)
    err = refused(proj.root, capsys, "regen", "--all", *FROM)
    assert "key 'output' = 'generated/joint/processors.py': resolves to" in err and "outside the generated" in err
    assert outside.read_text() == "precious\n"
