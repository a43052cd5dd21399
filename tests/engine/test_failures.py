"""Every failure of the CLI is one clear message and exit 2 (user error) or 1 (drift), never a traceback (issue 11,
item 8): unexpected exceptions, OS errors, bytes that are not UTF-8, and inputs big or deep enough to exhaust the
engine, which fail fast at a stated limit."""

from __future__ import annotations

import time

import pytest

from patchgen import project as project_module
from patchgen import spec_set as spec_set_module
from patchgen.spec_schema import MAX_PATCHES, MAX_SPEC_BYTES
from patchgen.spec_set import MAX_WRAPS_PER_ANCHOR, MAX_WRAPS_PER_SCOPE
from patchgen.upstream import MAX_UPSTREAM_BYTES
from patchgen.wheels import wheel_cache
from tests.engine.helpers import (
    ALL_OPS,
    TOY,
    VERSION,
    build_wheel,
    record_wheel,
    run_cli,
    spec_toml,
    upstream_text,
)

FROM = ("--from", f"fixturepkg=={VERSION}")
WRAP = dict(template="fx/wrap_guard", scope="ToyForTask.forward", anchor="self.loss_function", why="w")


@pytest.fixture
def generated(project, capsys):
    proj = project(spec_toml(patches=ALL_OPS))
    build_wheel(wheel_cache(proj.root), VERSION)
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 0, err
    return proj


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("error: ") : -1]


def test_an_unexpected_exception_exits_2_with_one_line_and_a_debug_hint(generated, capsys, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(project_module, "check_spec", broken)
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 2
    assert one_error_line(err) == (
        "internal error: RuntimeError: boom (a bug in patchgen; rerun with PATCHGEN_DEBUG=1 to see the traceback)"
    )
    monkeypatch.setenv("PATCHGEN_DEBUG", "1")
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 2 and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


@pytest.mark.parametrize("error", [RecursionError("maximum recursion depth exceeded"), MemoryError()])
def test_exhaustion_is_not_reported_as_drift(generated, capsys, monkeypatch, error) -> None:
    def exhausted(*args, **kwargs):
        raise error

    monkeypatch.setattr(project_module, "check_spec", exhausted)
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 2 and "PATCHGEN_DEBUG=1" in one_error_line(err)


def test_an_os_error_names_the_file(generated, capsys, monkeypatch) -> None:
    spec = generated.root / "specs" / "toy.toml"

    def denied(path, templates_dir):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(spec_set_module, "load_spec", denied)
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 2 and one_error_line(err) == f"{spec}: Permission denied"


def test_generated_files_that_are_not_utf8_are_drift(generated, capsys) -> None:
    target = generated.root / "generated" / "toy" / "modeling_toy.py"
    target.write_bytes(target.read_bytes().replace(b"return [0.5] * length", b"return [0.5] * length  # \xff"))
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 1 and "DRIFT generated/toy/modeling_toy.py: not UTF-8 text" in err, err
    assert run_cli(generated.root, capsys, "regen", "--all", *FROM)[0] == 0
    diff = target.with_name("modeling_toy.py.diff")
    diff.write_bytes(diff.read_bytes() + b"\xfe\n")
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 1 and "DRIFT generated/toy/modeling_toy.py.diff: review diff missing or stale" in err, err


def test_a_pyproject_that_is_not_utf8_is_a_user_error(generated, capsys) -> None:
    pyproject = generated.root / "pyproject.toml"
    pyproject.write_bytes(pyproject.read_bytes() + b"# \xff\n")
    code, _, err = run_cli(generated.root, capsys, "check", *FROM)
    assert code == 2 and one_error_line(err).startswith(f"{pyproject}: not UTF-8 text"), err


def test_an_upstream_file_that_is_not_utf8_is_a_user_error(project, capsys) -> None:
    proj = project(spec_toml())
    pyproject = proj.root / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().split("[tool.patchgen.wheel_sha256]")[0] + "[tool.patchgen.wheel_sha256]\n"
    )
    bad = upstream_text(TOY).encode().replace(b"Toy modeling module.", b"Toy modeling module \xff.")
    record_wheel(proj.root, build_wheel(wheel_cache(proj.root), VERSION, {TOY: bad}))
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 2 and "fixturepkg/models/modeling_toy.py in fixturepkg-1.2.3-py3-none-any.whl: not UTF-8" in err


def test_a_thousand_nested_wraps_fail_fast_at_the_limit(project, capsys) -> None:
    proj = project(spec_toml(patches=[WRAP] * 1000))
    started = time.perf_counter()
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 2 and time.perf_counter() - started < 5
    assert one_error_line(err) == (
        f"{proj.root / 'specs' / 'toy.toml'}: 1000 patches; at most {MAX_PATCHES} per spec: split the model's "
        f"patches over fewer, larger templates"
    )
    proj.write_spec(spec_toml(patches=[WRAP] * (MAX_WRAPS_PER_ANCHOR + 1)))
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 2 and one_error_line(err) == (
        f"{proj.root / 'specs' / 'toy.toml'}: patches 1-{MAX_WRAPS_PER_ANCHOR + 1} wrap the same expression "
        f"'self.loss_function' in 'ToyForTask.forward' {MAX_WRAPS_PER_ANCHOR + 1} times; at most "
        f"{MAX_WRAPS_PER_ANCHOR} nested wraps: merge them into one template"
    )


def test_many_wraps_in_one_scope_fail_fast(project, capsys) -> None:
    anchors = ["out", "labels", "self", "super", "loss", "hidden", "self.loss_function", "super().forward"]
    patches = [{**WRAP, "anchor": anchors[i % len(anchors)]} for i in range(MAX_WRAPS_PER_SCOPE + 1)]
    proj = project(spec_toml(patches=patches))
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 2 and one_error_line(err).startswith(
        f"{proj.root / 'specs' / 'toy.toml'}: {MAX_WRAPS_PER_SCOPE + 1} wrap patches in 'ToyForTask.forward'; at most "
        f"{MAX_WRAPS_PER_SCOPE} per scope"
    )


def test_a_huge_spec_or_upstream_file_fails_fast(project, capsys, monkeypatch) -> None:
    proj = project(spec_toml() + "# " + "x" * MAX_SPEC_BYTES + "\n")
    build_wheel(wheel_cache(proj.root), VERSION)
    code, _, err = run_cli(proj.root, capsys, "check", *FROM)
    assert code == 2 and one_error_line(err).startswith(f"{proj.root / 'specs' / 'toy.toml'}: ")
    assert f"larger than {MAX_SPEC_BYTES // 1024} KiB" in err
    monkeypatch.setattr("patchgen.upstream.MAX_UPSTREAM_BYTES", 1000)
    proj.write_spec(spec_toml())
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 2 and "fixturepkg/models/modeling_toy.py in fixturepkg-1.2.3-py3-none-any.whl: " in err
    assert "larger than 1000 bytes" in err and MAX_UPSTREAM_BYTES > 1 << 20


def test_upstream_nested_deeper_than_python_parses_is_a_user_error(project, capsys) -> None:
    proj = project(spec_toml())
    deep = upstream_text(TOY) + "\nDEEP = " + "f(" * 250 + "1" + ")" * 250 + "\n"
    pyproject = proj.root / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().split("[tool.patchgen.wheel_sha256]")[0] + "[tool.patchgen.wheel_sha256]\n"
    )
    record_wheel(proj.root, build_wheel(wheel_cache(proj.root), VERSION, {TOY: deep}))
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", *FROM)
    assert code == 2 and "too many nested parentheses" in one_error_line(err), err
    assert "fixturepkg/models/modeling_toy.py (fixturepkg==1.2.3)" in err
