"""Where generated files may go and which files under `generated/` a project owns (issue 11, items 1 and 7).

`output` must resolve (symlinks included) inside `[tool.patchgen] generated`; package `__init__.py` files are only
written inside it; zero specs, two specs sharing an output and files no spec owns are errors.
"""

from __future__ import annotations

import os

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.ownership import owned_paths
from patchgen.project import check, regen
from patchgen.spec_set import load_specs
from patchgen.wheels import wheel_cache
from tests.engine.helpers import ALL_OPS, VERSION, FixtureSource, build_wheel, run_cli, spec_toml


def regen_all(proj):
    return regen(proj.config, load_specs(proj.config, None), source=FixtureSource())


@pytest.mark.parametrize(
    "output",
    [
        "../../outside/x.py",
        "patchgen/errors.py",
        "generated/../runtime/train/loop.py",
        "generated/__init__.py",  # a package file every output's package needs
        "generated/toy/__init__.py",
        "./generated/toy/modeling_toy.py",  # not the plain path the header and the orphan check compare
    ],
)
def test_output_outside_the_generated_dir_is_refused_before_anything_is_written(project, output) -> None:
    proj = project(spec_toml(output=output, patches=ALL_OPS))
    (proj.root / "runtime" / "train").mkdir(parents=True)
    (proj.root / "runtime" / "train" / "loop.py").write_text("# the trainer\n")
    before = proj.snapshot()
    with pytest.raises(PatchgenError) as err:
        regen_all(proj)
    message = str(err.value)
    assert message.startswith(f"{proj.root / 'specs' / 'toy.toml'}: key 'output' = {output!r}: "), message
    assert "\n" not in message
    assert proj.snapshot() == before
    assert not (proj.root.parent / "outside").exists()


def test_output_through_a_symlink_out_of_the_generated_dir_is_refused(project, tmp_path) -> None:
    proj = project(spec_toml(output="generated/link/modeling_toy.py"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (proj.root / "generated").mkdir()
    os.symlink(elsewhere, proj.root / "generated" / "link")
    with pytest.raises(PatchgenError, match=r"toy.toml: key 'output' = 'generated/link/modeling_toy.py': .*resolves"):
        regen_all(proj)
    assert list(elsewhere.iterdir()) == []


def test_package_files_are_written_only_inside_the_generated_dir(project) -> None:
    proj = project(spec_toml(output="src/gen/toy/modeling_toy.py"))
    pyproject = proj.root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('generated = "generated"', 'generated = "src/gen"'))
    regen_all(proj)
    inits = sorted(p.relative_to(proj.root).as_posix() for p in proj.root.rglob("__init__.py"))
    assert inits == ["src/gen/__init__.py", "src/gen/toy/__init__.py"]


def test_generated_dir_must_lie_inside_the_project(project) -> None:
    for value in ("..", ".", "/tmp"):
        proj = project(spec_toml())
        pyproject = proj.root / "pyproject.toml"
        pyproject.write_text(pyproject.read_text().replace('generated = "generated"', f'generated = "{value}"'))
        with pytest.raises(PatchgenError, match=rf"pyproject.toml: \[tool.patchgen\] generated = '{value}'"):
            load_config(proj.root)


def test_zero_specs_is_an_error(project) -> None:
    proj = project()
    with pytest.raises(PatchgenError, match=r"no specs: .*specs has no \*\.toml file"):
        load_specs(proj.config, None)
    pyproject = proj.root / "pyproject.toml"
    proj.write_spec(spec_toml())
    pyproject.write_text(pyproject.read_text().replace('specs = "specs"', 'specs = "spec"'))  # a typo
    with pytest.raises(PatchgenError, match=r"\[tool.patchgen\] specs = 'spec'"):
        load_specs(proj.config, None)


def test_two_specs_with_the_same_output_are_an_error(project) -> None:
    proj = project({"a": spec_toml(), "b": spec_toml(keep=["ToyConfig"])})
    with pytest.raises(PatchgenError) as err:
        load_specs(proj.config, None)
    assert str(err.value) == (
        f"{proj.root / 'specs' / 'b.toml'}: key 'output' = 'generated/toy/modeling_toy.py' is also the output of "
        f"{proj.root / 'specs' / 'a.toml'}; give each spec its own output"
    )
    with pytest.raises(PatchgenError, match="is also the output of"):  # loading one of them is enough
        load_specs(proj.config, ["b"])


def test_files_no_spec_owns_are_reported_by_a_whole_project_check(project) -> None:
    proj = project(
        {"toy": spec_toml(patches=ALL_OPS), "other": spec_toml(output="generated/other/m.py", keep=["ToyConfig"])}
    )
    regen_all(proj)
    config, source = proj.config, FixtureSource()
    specs = load_specs(config, None)
    assert check(config, specs, source=source) == []
    generated = proj.root / "generated"
    (generated / "stray.py").write_text("x = 1\n")
    (generated / "toy" / "modeling_old.py.diff").write_text("")
    (generated / "toy" / "__pycache__").mkdir()
    (generated / "toy" / "__pycache__" / "modeling_toy.cpython-311.pyc").write_bytes(b"\0")
    drifts = check(config, specs, source=source)
    assert [(d.path.relative_to(proj.root).as_posix(), d.reason) for d in drifts] == [
        ("generated/stray.py", "no spec owns it (a removed or renamed spec's output?); delete it or restore its spec"),
        (
            "generated/toy/modeling_old.py.diff",
            "no spec owns it (a removed or renamed spec's output?); delete it or restore its spec",
        ),
    ]
    assert check(config, [s for s in specs if s.name == "toy"], source=source) == []  # a partial check cannot tell
    # regen --all writes what the specs produce and still reports the strays (it never deletes files)
    changes = regen(config, specs, source=source)
    assert [c.path.name for c in changes if c.status == "orphan"] == ["stray.py", "modeling_old.py.diff"]
    assert (generated / "stray.py").is_file()


def test_cli_reports_orphans_as_drift_and_zero_specs_as_a_user_error(project, capsys) -> None:
    proj = project({"toy": spec_toml(patches=ALL_OPS), "b": spec_toml(output="generated/b/m.py", keep=["ToyConfig"])})
    build_wheel(wheel_cache(proj.root), VERSION)
    pinned = ("--from", f"fixturepkg=={VERSION}")
    assert run_cli(proj.root, capsys, "regen", "--all", *pinned)[0] == 0
    (proj.root / "generated" / "toy" / "modeling_renamed.py").write_text("")
    code, out, err = run_cli(proj.root, capsys, "regen", "--all", *pinned)
    assert code == 1 and "   orphan  generated/toy/modeling_renamed.py  (no spec owns it" in err, err
    code, _, err = run_cli(proj.root, capsys, "check", *pinned)
    assert code == 1 and "DRIFT generated/toy/modeling_renamed.py: no spec owns it" in err
    assert run_cli(proj.root, capsys, "check", "toy", *pinned)[0] == 0
    (proj.root / "specs" / "toy.toml").unlink()
    (proj.root / "specs" / "b.toml").unlink()
    for command in (("check",), ("regen", "--all"), ("list",)):
        code, _, err = run_cli(proj.root, capsys, *command, *pinned[: 2 if command[0] != "list" else 0])
        assert code == 2 and err.startswith("error: no specs: "), (command, err)


def test_owned_paths_cover_every_file_regen_writes(project) -> None:
    proj = project(spec_toml(patches=ALL_OPS))
    changes = regen_all(proj)
    assert {c.path for c in changes} <= owned_paths(proj.config, proj.spec().output)
    assert {p.relative_to(proj.root).as_posix() for p in owned_paths(proj.config, proj.spec().output)} == {
        "generated/__init__.py",
        "generated/toy/__init__.py",
        "generated/toy/modeling_toy.py",
        "generated/toy/modeling_toy.py.diff",
        "generated/toy/modeling_toy.model.json",
    }


@pytest.mark.parametrize(
    "module, message",
    [
        ("os", "'os' is a standard-library module, not an upstream package"),
        ("numpy.linalg", "package 'numpy' is not pinned"),
    ],
)
def test_module_of_an_unpinned_package_is_a_spec_error(project, module, message) -> None:
    proj = project(spec_toml(module=module))
    with pytest.raises(PatchgenError) as err:
        load_specs(proj.config, None)
    text = str(err.value)
    assert text.startswith(f"{proj.root / 'specs' / 'toy.toml'}: key 'module' = {module!r}: ") and message in text
    assert "add it to [tool.patchgen] pins" not in text or module != "os"
