"""The `patchgen` command line against a temp copy of the real project (pyproject, specs, templates, generated).

Every command runs in a subprocess, as CI runs it. The upstream is the installed transformers, read as text.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.engine.helpers import REPO

PATCHGEN = Path(sys.executable).parent / "patchgen"
QWEN3 = "generated/qwen3/modeling_qwen3.py"


def installed_transformers() -> tuple[Path, str]:
    spec = importlib.util.find_spec("transformers")  # locates the package without importing it (nor torch)
    assert spec is not None and spec.submodule_search_locations
    root = Path(list(spec.submodule_search_locations)[0])
    from importlib.metadata import version

    return root, version("transformers")


@pytest.fixture
def real(tmp_path: Path) -> Path:
    """A copy of the real project; commands get `--root` pointing at it and run from an unrelated cwd."""
    root = tmp_path / "proj"
    root.mkdir()
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    for name in ("specs", "templates", "generated"):
        shutil.copytree(REPO / name, root / name)
    return root


def patchgen(root: Path, *args: str) -> subprocess.CompletedProcess:
    command, *rest = args
    return subprocess.run(
        [str(PATCHGEN), command, *rest, "--root", str(root)],
        cwd=root.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def in_process(root: Path, capsys, *args: str) -> tuple[int, str, str]:
    """`patchgen <args> --root <root>` through cli.main in this process: the console script's exit-code path
    without an interpreter start (the subprocess runs in this file cover the script itself)."""
    from patchgen.cli import main

    command, *rest = args
    argv = sys.argv
    sys.argv = ["patchgen", command, *rest, "--root", str(root)]
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def generated_snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {k: v for k, v in snapshot(root).items() if k.startswith("generated/")}


def models(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "specs").glob("*.toml"))


def edit_why(root: Path, model: str, index: int) -> str:
    """Append to the `why` of patch `index` (1-based) in the spec; returns the new why."""
    spec = root / "specs" / f"{model}.toml"
    old = spec_patches(root, model)[index - 1]["why"]
    new = old + " (edited)"
    text = spec.read_text()
    assert text.count(f'why = "{old}"') == 1
    spec.write_text(text.replace(f'why = "{old}"', f'why = "{new}"'))
    return new


def normalized(code: str) -> str:
    try:
        return ast.unparse(ast.parse(code.strip(), mode="eval"))
    except SyntaxError:
        return ast.unparse(ast.parse(code.strip()))


def spec_patches(root: Path, model: str) -> list[dict]:
    return tomllib.loads((root / "specs" / f"{model}.toml").read_text())["patch"]


def spec_data(root: Path, model: str) -> dict:
    return tomllib.loads((root / "specs" / f"{model}.toml").read_text())["model"]["data"]


def expression_line(module_path: Path, scope: str, anchor: str) -> int:
    """Upstream line of the one expression (or statement) in `scope` equal to `anchor`, found with `ast`."""
    tree = ast.parse(module_path.read_text(encoding="utf-8"))
    node: ast.AST = tree
    for part in scope.split("."):
        node = next(n for n in node.body if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == part)
    try:
        wanted = ast.unparse(ast.parse(anchor.strip(), mode="eval").body)
        kind = ast.expr
    except SyntaxError:
        wanted = ast.unparse(ast.parse(anchor.strip()).body[0])
        kind = ast.stmt
    lines = [n.lineno for n in ast.walk(node) if isinstance(n, kind) and ast.unparse(n) == wanted]
    assert len(lines) == 1, (scope, anchor, lines)
    return lines[0]


def test_list_shows_every_model(real, capsys) -> None:
    code, out, err = in_process(real, capsys, "list")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines() if not line.startswith(" ")] == models(real)
    assert {"llama", "qwen3"} <= set(models(real))
    # the released models one spec serves, from its [model.data] released (the Wan spec serves Wan2.1 and Wan2.2)
    serves = {line.split()[0]: line for line in out.splitlines() if not line.startswith(" ")}
    lines = out.splitlines()
    wan = lines[lines.index(serves["wan"]) + 1]
    assert wan.split() == ["serves:", *", ".join(spec_data(real, "wan")["released"]).split()], wan
    assert "Wan2.2-TI2V-5B" in wan and "Wan2.2-T2V-A14B" in wan, wan
    count = len(spec_patches(real, "qwen3")) + 1  # + the conversions patch its [model] table implies
    assert re.search(rf"^qwen3 +transformers\.models\.qwen3\.modeling_qwen3 +{QWEN3}  \({count} patches\)$", out, re.M)


CHECK_WITHOUT_TORCH = textwrap.dedent("""
    import sys
    from patchgen.cli import main

    root, codes = sys.argv[1], []
    for extra in ([], ["--full"]):
        sys.argv = ["patchgen", "check", "--root", root, *extra]
        try:
            main()
            codes.append("no exit")
        except SystemExit as exc:
            codes.append(exc.code)
    leaked = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    print("exit", codes, "leaked", leaked)
""")


def test_check_passes_and_never_imports_torch_or_transformers(real) -> None:
    """`check` (hash fast path) and `check --full` (regenerates from upstream text) both exit 0, torch-free."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", CHECK_WITHOUT_TORCH, str(real)],
        cwd=real.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert f"ok: {len(models(real))} spec(s) match generated/" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "exit [0, 0] leaked []", result.stdout + result.stderr


def test_stale_review_diff_is_drift(real, capsys) -> None:
    (real / (QWEN3 + ".diff")).write_text("stale\n")
    code, _, err = in_process(real, capsys, "check")
    assert code == 1
    assert f"DRIFT {QWEN3}.diff: review diff missing or stale" in err


def test_check_fails_on_a_one_character_edit_and_names_the_file(real) -> None:
    target = real / QWEN3
    text = target.read_text()
    at = text.index("class Qwen3RMSNorm")
    target.write_text(text[:at] + "class Qwen3RmSNorm" + text[at + len("class Qwen3RMSNorm") :])
    result = patchgen(real, "check")
    assert result.returncode == 1
    assert f"DRIFT {QWEN3}: edited by hand" in result.stderr
    assert "-class Qwen3RmSNorm" in result.stderr and "+class Qwen3RMSNorm" in result.stderr
    assert "llama" not in result.stderr.split("\n")[0]


def test_regen_with_a_missing_anchor_exits_2_lists_candidates_and_writes_nothing(real) -> None:
    spec = real / "specs" / "qwen3.toml"
    index, patch = next(
        (i, p)
        for i, p in enumerate(spec_patches(real, "qwen3"), start=1)
        if p.get("anchor", "").endswith(")") and "(" in p["anchor"]
    )  # a call anchor
    anchor = patch["anchor"]
    missing = anchor[:-1] + "_missing)"  # a call that upstream does not contain
    spec.write_text(spec.read_text().replace(f'anchor = "{anchor}"', f'anchor = "{missing}"'))
    before = generated_snapshot(real)
    result = patchgen(real, "regen", "qwen3")
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"error: {spec}: patch {index} ({patch['template']}) in scope "
        f"'{patch['scope']}': anchor {missing!r} matches no "
    )
    root, version = installed_transformers()
    where = f"transformers=={version} transformers/models/qwen3/modeling_qwen3.py"
    assert f"nearest candidates in {where}:" in result.stderr
    found = re.findall(r"^ {4}line (\d+): (.*)$", result.stderr, re.M)
    upstream = root / "models" / "qwen3" / "modeling_qwen3.py"
    assert found[0] == (str(expression_line(upstream, patch["scope"], anchor)), normalized(anchor))
    assert generated_snapshot(real) == before


def test_explain_prints_template_upstream_line_and_rendered_code(real, capsys) -> None:
    code, out, err = in_process(real, capsys, "explain", "qwen3")
    assert code == 0, err
    root, version = installed_transformers()
    upstream = root / "models" / "qwen3" / "modeling_qwen3.py"
    assert out.startswith(
        f"qwen3: qwen3.toml -> {QWEN3} from transformers=={version} transformers/models/qwen3/modeling_qwen3.py\n"
    )
    sections = out.split("\n#")[1:]
    patches = spec_patches(real, "qwen3")
    assert len(sections) == len(patches) + 1  # the last one is implied by the [model] table
    assert sections[-1].startswith(f"{len(patches) + 1} core/upstream_weight_conversions (op add_definition) @ ")
    for index, (section, patch) in enumerate(zip(sections[:-1], patches, strict=True), start=1):
        header = section.splitlines()[0]
        match = re.fullmatch(
            rf"{index} {re.escape(patch['template'])} \(op (\w+)\) @ {re.escape(patch['scope'])}, "
            rf"upstream line (\d+)",
            header,
        )
        assert match, header
        assert int(match.group(2)) == expression_line(upstream, patch["scope"], patch["anchor"])
        assert f"  why: {patch['why']}\n" in section and f"  anchor: {patch['anchor']}\n" in section
        rendered = section.split("  rendered:\n", 1)[1]
        assert rendered.startswith("    | ")
        if match.group(1) == "wrap":  # a wrap's rendered code contains the wrapped expression
            assert patch["anchor"] in rendered.splitlines()[0]


def test_regen_all_dry_run_writes_nothing(real) -> None:
    """One dry run over the whole project after an edit: what would change is said (qwen3 and qwen2, which inherits
    the edited why), every other output is unchanged, and nothing is written (a clean project's `regen --all` says
    unchanged everywhere: test_regen_rewrites_only_what_changed)."""
    edit_why(real, "qwen3", 2)
    before = snapshot(real)
    result = patchgen(real, "regen", "--all", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"  changed  {QWEN3}  (would write)" in result.stdout
    assert f"  changed  {QWEN3}.diff  (would write)" in result.stdout
    assert "unchanged  generated/llama/modeling_llama.py\n" in result.stdout
    changed = {line.split()[1] for line in result.stdout.splitlines() if line.split()[0] != "unchanged"}
    assert {path.split("/")[1] for path in changed} == {"qwen3", "qwen2"}, changed
    assert snapshot(real) == before


def test_regen_rewrites_only_what_changed(real, capsys) -> None:
    code, out, _ = in_process(real, capsys, "regen", "--all")
    assert code == 0 and {line.split()[0] for line in out.splitlines()} == {"unchanged"}
    why = edit_why(real, "qwen3", 2)
    before = snapshot(real)
    code, out, err = in_process(real, capsys, "regen", "qwen3")
    assert code == 0, err
    assert f"  changed  {QWEN3}  (wrote)" in out
    assert "  changed  generated/qwen2/modeling_qwen2.py  (wrote)" in out  # qwen2 extends qwen3: it inherits the why
    after = snapshot(real)
    qwen2 = "generated/qwen2/modeling_qwen2.py"
    assert {k for k in after if after[k] != before[k]} == {QWEN3, QWEN3 + ".diff", qwen2, qwen2 + ".diff"}
    template = spec_patches(real, "qwen3")[1]["template"]
    marker = rf"# patchgen #2 {re.escape(template)} \(\d+ stmt\): {re.escape(why)}\n"
    assert re.search(marker, (real / QWEN3).read_text())
    # a spec that extends qwen3 inherits the edit: `regen qwen3` regenerated it too, so nothing drifts
    assert in_process(real, capsys, "check")[0] == 0


def test_regen_and_check_refuse_an_installed_version_other_than_the_pin(real, capsys) -> None:
    _, version = installed_transformers()
    pyproject = real / "pyproject.toml"
    text = pyproject.read_text()
    assert f'transformers = "{version}"' in text
    pyproject.write_text(text.replace(f'transformers = "{version}"', 'transformers = "5.13.0"'))
    before = generated_snapshot(real)
    result = patchgen(real, "regen", "qwen3")
    assert result.returncode == 2
    assert f"installed transformers=={version} but the pin is transformers==5.13.0" in result.stderr
    code, _, err = in_process(real, capsys, "check")
    assert code == 2 and f"installed transformers=={version} but the pin is transformers==5.13.0" in err
    assert generated_snapshot(real) == before


def test_diff_prints_the_checked_in_review_diff(real, capsys) -> None:
    code, out, err = in_process(real, capsys, "diff", "qwen3")
    assert code == 0, err
    assert out == (real / (QWEN3 + ".diff")).read_text()
    assert out.startswith("--- a/transformers/models/qwen3/modeling_qwen3.py (transformers==") and "\n+++ b/" in out


def test_usage_errors_exit_2_with_a_message_not_a_traceback(real, capsys) -> None:
    result = patchgen(real, "regen", "--bogus")
    assert result.returncode == 2 and "no such option: --bogus" in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    for args, message in (
        (("regen",), "name the models to regenerate, or pass --all"),
        (("explain",), "missing argument"),
        (("regen", "qwen4"), "unknown model(s) ['qwen4']"),
    ):
        code, _, err = in_process(real, capsys, *args)
        assert code == 2 and message in err, (args, err)
    assert in_process(real, capsys, "check", "--help")[0] == 0
