"""`patchgen upgrade --verify`: the per-model classification on synthetic pytest outcomes, and one real verification
(flux on diffusers 0.42.1, from the cached wheel) that leaves the project's generated/ and venv as they were."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patchgen.scratch_env import unmet_requirements
from patchgen.verify import (
    COPIED,
    FAILING,
    NO_TEST,
    NOT_REGENERATED,
    PROVEN,
    Outcome,
    classify,
    mentioned,
    read_junit,
)
from patchgen.wheels import CACHE_DIR
from tests.engine.test_upgrade_report import covered_models, without_appended

ROOT = Path(__file__).resolve().parents[2]
DIFFUSERS_REPORT = ROOT / "docs" / "upgrades" / "diffusers-0.42.1.md"
NAMES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "wan": "wan", "flux": "flux", "qwen2_5_vl": "qwen2_5_vl"}


def test_a_name_counts_only_as_a_whole_part_of_the_test_name() -> None:
    assert mentioned("tests/parity/test_dense_off.py::test_bitwise[False-qwen3_moe]", NAMES) == {"qwen3_moe"}
    assert mentioned("tests/parity/test_dense_off.py::test_bitwise[True-qwen3]", NAMES) == {"qwen3"}
    assert mentioned("tests/models/test_conversions.py::test_a_legacy_qwen2_5_vl_checkpoint", NAMES) == {"qwen2_5_vl"}
    assert mentioned("tests/dit/test_sp.py::test_sp2_matches_single_process", NAMES) == set()
    assert mentioned("tests/flux/test_x.py::test_wanted[fluxes]", NAMES) == set()  # not the path, not sub-words


def test_classification_per_model() -> None:
    outcomes = [
        Outcome("tests/parity/test_dense_off.py::test_bitwise[False-qwen3]", "passed"),
        Outcome("tests/fidelity/test_save_load.py::test_save_load_both_ways[qwen3]", "passed"),
        Outcome("tests/parity/test_dense_off.py::test_bitwise[False-qwen3_moe]", "failed", "AssertionError"),
        Outcome("tests/parity/test_dense_off.py::test_bitwise[True-qwen3_moe]", "passed"),
        Outcome("tests/dit/test_off_parity.py::test_generated_equals_diffusers_bitwise[flux]", "skipped"),
        Outcome("tests/parity/test_dense_sp.py::test_sp2_matches_single_process", "passed"),
    ]
    proofs, ignored = classify(["qwen3", "qwen3_moe", "flux"], ["wan"], outcomes, NAMES)
    got = {p.model: (p.status, p.failing, p.passed) for p in proofs}
    assert got == {
        "flux": (NO_TEST, (), 1),  # a skipped test proves nothing; the shared one passed
        "qwen3": (PROVEN, (), 3),
        "qwen3_moe": (FAILING, ("tests/parity/test_dense_off.py::test_bitwise[False-qwen3_moe]",), 2),
        "wan": (NOT_REGENERATED, (), 0),
    }
    assert [p.label for p in proofs if p.model == "qwen3_moe"] == [
        "regenerated but failing (tests/parity/test_dense_off.py::test_bitwise[False-qwen3_moe])"
    ]
    assert ignored == []


def test_a_failing_shared_test_fails_every_model_unless_it_looks_up_a_model_left_out() -> None:
    own = [Outcome("t.py::test_a[qwen3]", "passed"), Outcome("t.py::test_a[qwen3_moe]", "passed")]
    shared = Outcome("tests/parity/test_dense_sp.py::test_sp2_matches_single_process", "failed", "AssertionError")
    proofs, _ = classify(["qwen3", "qwen3_moe"], [], [*own, shared], NAMES)
    assert {p.model: p.label for p in proofs} == {
        "qwen3": f"{FAILING} ({shared.test})",
        "qwen3_moe": f"{FAILING} ({shared.test})",
    }
    absent = [
        Outcome("tests/dit/test_shell_args.py", "error", "KeyError: 'wan'"),
        Outcome("tests/dit/test_checkpoint.py::test_registry", "failed", "AssertionError: assert 'wan' in ['flux']"),
        Outcome("tests/parity/dense.py", "error", "ValueError: no generated model for model_type 'qwen3'; known: x"),
    ]
    proofs, ignored = classify(["flux"], [], [Outcome("t.py::test_b[flux]", "passed"), *absent], NAMES)
    assert [(p.model, p.status) for p in proofs] == [("flux", PROVEN)]
    assert ignored == absent
    proofs, _ = classify(["qwen3"], [], [Outcome("t.py::test_b[qwen3]", "passed"), absent[2]], NAMES)
    assert proofs[0].status == FAILING  # the model it looks up is being verified: that failure counts


def test_no_pytest_result_proves_nothing() -> None:
    proofs, _ = classify(["qwen3"], [], [], NAMES, problem="timed out after 10 s")
    assert proofs[0].label == f"{FAILING} (pytest: timed out after 10 s)"


def test_junit_outcomes(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.dit.test_x" name="test_a[flux]" />'
        '<testcase classname="tests.dit.test_x" name="test_b"><failure message="m">x\nE   KeyError: \'wan\'\n'
        "</failure></testcase>"
        '<testcase classname="tests.dit.test_x" name="test_c"><skipped message="s" /></testcase>'
        '<testcase classname="" name="tests.dit.test_y"><error message="collection failure">E  boom</error>'
        "</testcase></testsuite></testsuites>"
    )
    assert read_junit(xml) == [
        Outcome("tests/dit/test_x.py::test_a[flux]", "passed"),
        Outcome("tests/dit/test_x.py::test_b", "failed", "KeyError: 'wan'"),
        Outcome("tests/dit/test_x.py::test_c", "skipped"),
        Outcome("tests.dit.test_y", "error", "boom"),
    ]


def _dist(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")


def test_requirements_of_the_scratch_packages_are_checked_against_the_layered_ones(tmp_path: Path) -> None:
    scratch, project = tmp_path / "scratch", tmp_path / "project"
    _dist(scratch, "newpkg", "2.0", "dep-a>=0.23.1,<0.24", "dep-b", "dep-c>=1", 'dep-d; extra == "dev"')
    _dist(scratch, "dep-c", "1.1")
    _dist(project, "dep-a", "0.22.2")
    _dist(project, "dep-c", "0.5")  # shadowed by the scratch venv's own dep-c 1.1, as on sys.path
    assert unmet_requirements([scratch, project], ["newpkg"]) == [
        "dep-a<0.24,>=0.23.1 (of newpkg; 0.22.2 installed)",
        "dep-b (of newpkg; not installed)",
    ]
    _dist(scratch, "dep-a", "0.23.3")
    assert unmet_requirements([scratch, project], ["newpkg"]) == ["dep-b (of newpkg; not installed)"]


def _tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _venv_state() -> tuple[str, str, str]:
    """The project venv's transformers and diffusers versions and diffusers' RECORD (its files, with hashes)."""
    dist = importlib.metadata.distribution("diffusers")
    return importlib.metadata.version("transformers"), dist.version, dist.read_text("RECORD") or ""


def test_verify_proves_flux_on_diffusers_0_42_1_and_changes_nothing_in_the_project(tmp_path: Path) -> None:
    """The same run writes the committed review of diffusers 0.42.1 (its analysis, less the proof it appends) with
    the specs that review covers: the report test leaves that one to this test, which runs the analysis anyway."""
    committed = without_appended(DIFFUSERS_REPORT.read_text())
    left_out = [f.name for f in (ROOT / "specs").glob("*.toml") if f.stem not in covered_models(committed)]
    project = tmp_path / "project"
    project.mkdir()
    for name in COPIED:
        src = ROOT / name
        ignore = shutil.ignore_patterns("__pycache__")
        if name == "specs":  # specs added after the review was made are not in it
            ignore = shutil.ignore_patterns("__pycache__", *left_out)
        (shutil.copytree(src, project / name, ignore=ignore) if src.is_dir() else shutil.copy(src, project / name))
    if (ROOT / CACHE_DIR).is_dir():  # the cached wheel; a clean clone downloads it once
        shutil.copytree(ROOT / CACHE_DIR, project / CACHE_DIR)
    before = (_tree_hash(project / "generated"), _tree_hash(project / "specs"), _venv_state())
    report = tmp_path / DIFFUSERS_REPORT.name
    done = subprocess.run(
        [sys.executable, "-m", "patchgen.cli", "upgrade", "--to", "diffusers==0.42.1", "--verify-model", "flux"]
        + ["--root", str(project), "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode == 2 and "download" in done.stderr.lower():
        pytest.skip(f"cannot obtain the diffusers==0.42.1 wheel here (no registry access): {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (_tree_hash(project / "generated"), _tree_hash(project / "specs"), _venv_state()) == before
    text = report.read_text()
    assert "**1 of 1 model(s) proven at parity on diffusers==0.42.1.**" in text
    row = re.search(r"^\| flux \| (\d+) of \1 \| proven \| (\d+) \|$", text, re.M)
    assert row is not None and int(row.group(2)) >= 5, text[text.index("## Proof") :]
    again = f"regenerate {DIFFUSERS_REPORT.relative_to(ROOT)} with patchgen upgrade --report"
    assert without_appended(text) == committed, again
    diffs = {p.name: p.read_text() for p in sorted(DIFFUSERS_REPORT.with_suffix("").glob("*.diff"))}
    assert {p.name: p.read_text() for p in sorted(report.with_suffix("").glob("*.diff"))} == diffs, again


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "nopkg==1.0", "--verify"], "unknown package 'nopkg'"),
        (["--to", "diffusers==9.9.9", "--verify"], "no sha256 recorded for diffusers==9.9.9"),
        (["--to", "diffusers==0.42.1", "--verify-model", "nope"], "--verify-model nope: no spec of that name"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "patchgen.cli", "upgrade", *args, "--root", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
