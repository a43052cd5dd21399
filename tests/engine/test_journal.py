"""All-or-nothing writes (issue 11, item 4): a failure or a kill at any step of a commit leaves the whole old set of
outputs or, once the next patchgen command has finished the interrupted commit, the whole new set.

Kills are real: the commit runs in a forked child that `os._exit`s right before its N-th file-system call, for every
N until the commit completes; the parent then runs what every patchgen command runs first (`recover`, or the CLI).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from patchgen import files
from patchgen.config import load_config, with_pins
from patchgen.errors import PatchgenError
from patchgen.files import TXN_DIR, write_atomic
from patchgen.generate import generate
from patchgen.ownership import confinement, finish_interrupted_write, outputs
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.engine.helpers import ALL_OPS, FixtureSource, run_cli, spec_toml

# every os call by which a commit touches the disk; the child dies before one of them
FS_CALLS = ("open", "write", "fsync", "replace", "rename", "link", "unlink", "mkdir", "rmdir", "symlink")
KILLED = 77


def state(root: Path) -> dict[str, bytes]:
    """Every file under generated/ (and pyproject.toml), by content, plus whatever the commit left at the root."""
    found = {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / "generated").rglob("*") if p.is_file()}
    found["pyproject.toml"] = (root / "pyproject.toml").read_bytes()
    return found


def recover(root: Path) -> str | None:
    """What every patchgen command runs first."""
    return finish_interrupted_write(load_config(root))


def old_and_new(project) -> tuple[Path, dict[Path, str], dict[str, bytes], dict[str, bytes]]:
    """A project with two models generated (old); the new set changes both, adds a third model in a new directory
    and moves the pins in pyproject.toml (as `upgrade --apply` does)."""
    proj = project(
        {
            "toy": spec_toml(patches=ALL_OPS),
            "other": spec_toml(output="generated/other/modeling_other.py", keep=["ToyConfig"]),
        }
    )
    config, source = proj.config, FixtureSource()
    regen(config, load_specs(config, None), source=source)
    old = state(proj.root)
    changed = [{**p, "why": p["why"] + " (v2)"} for p in ALL_OPS]
    proj.write_spec(spec_toml(patches=changed))
    proj.write_spec(spec_toml(output="generated/other/modeling_other.py", keep=["ToyConfig", "rescale"]), "other")
    proj.write_spec(spec_toml(output="generated/third/deep/modeling_third.py", keep=["ToyModel"]), "third")
    new_files: dict[Path, str] = {}
    for spec in load_specs(config, None):
        new_files.update(outputs(config, generate(spec, source, config)))
    pyproject = proj.root / "pyproject.toml"
    new_files[pyproject] = with_pins(pyproject.read_text(), {"fixturepkg": "1.2.4"})
    new_files = {p: t for p, t in new_files.items() if not p.is_file() or p.read_text() != t}
    new = {**old, **{p.relative_to(proj.root).as_posix(): t.encode() for p, t in new_files.items()}}
    return proj.root, new_files, old, new


def commit_in_child(root: Path, new_files: dict[Path, str], kill_at: int, only: str | None = None) -> int:
    """Exit code of a forked child that commits `new_files` and dies right before its `kill_at`-th fs call (or its
    `kill_at`-th call of `os.<only>` that does not rename into the staging directory)."""
    allowed = confinement(load_config(root))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        count = [0]

        def counted(name, fn):
            def call(*args, **kwargs):
                if only is None or (name == only and Path(args[1]).parent.name != TXN_DIR):
                    count[0] += 1
                if count[0] == kill_at:
                    os._exit(KILLED)
                return fn(*args, **kwargs)

            return call

        for name in FS_CALLS:
            setattr(os, name, counted(name, getattr(os, name)))
        try:
            write_atomic(new_files, allowed)
        except BaseException:
            os._exit(1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_kill_at_every_step_of_a_commit_leaves_the_old_or_the_new_set(project) -> None:
    root, new_files, old, new = old_and_new(project)
    assert len(new_files) == 9 and any(not p.exists() for p in new_files)
    seen, kill_at = [], 1
    while True:
        code = commit_in_child(root, new_files, kill_at)
        assert code in (0, KILLED), code
        recover(root)  # what the next patchgen command does first
        after = state(root)
        assert after in (old, new), f"mixed state after a kill at step {kill_at}"
        assert not (root / TXN_DIR).exists() and sorted(p.name for p in root.iterdir()) == [
            "generated",
            "pyproject.toml",
            "specs",
            "templates",
        ]
        seen.append("new" if after == new else "old")
        if code == 0:
            break
        for path, data in old.items():  # back to the old set for the next kill point
            (root / path).write_bytes(data)
        shutil.rmtree(root / "generated" / "third", ignore_errors=True)  # the new model's directory
        kill_at += 1
    assert kill_at > 3 * len(new_files)  # staging, journal, renames, cleanup: every step was a kill point
    flips = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert seen[0] == "old" and seen[-1] == "new" and len(flips) == 1, seen  # one commit point


def test_the_cli_finishes_an_interrupted_commit_before_anything_else(project, capsys) -> None:
    root, new_files, old, new = old_and_new(project)
    assert commit_in_child(root, new_files, 6, only="replace") == KILLED  # after five targets were renamed
    assert state(root) not in (old, new) and (root / TXN_DIR / "journal.json").is_file()
    code, out, err = run_cli(root, capsys, "list")
    assert code == 0 and "finished an interrupted write" in err
    assert state(root) == new and not (root / TXN_DIR).exists()


@pytest.mark.parametrize("fail_at", range(1, 7))
def test_a_failing_rename_rolls_every_output_back(project, monkeypatch, fail_at) -> None:
    """An immutable target, a vanished directory, a full disk: whichever rename fails, nothing changes."""
    root, new_files, old, new = old_and_new(project)
    real, count = os.replace, [0]

    def flaky(src, dst, **kwargs):
        if Path(dst).parent.name != TXN_DIR:  # the journal's own rename is not a target
            count[0] += 1
            if count[0] == fail_at:
                raise PermissionError(1, "Operation not permitted", str(dst))
        return real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(PatchgenError) as err:
        write_atomic(new_files, confinement(load_config(root)))
    assert "Operation not permitted" in str(err.value) and "nothing was changed" in str(err.value)
    assert state(root) == old and not (root / TXN_DIR).exists()


def test_a_directory_where_a_target_should_be_changes_nothing(project) -> None:
    root, new_files, old, new = old_and_new(project)
    blocker = root / "generated" / "third"
    blocker.write_text("a file where a directory is needed\n")
    with pytest.raises(PatchgenError, match=r"generated/third: not a directory"):
        write_atomic(new_files, confinement(load_config(root)))
    blocker.unlink()
    (root / "generated" / "other" / "modeling_other.py.diff").unlink()
    (root / "generated" / "other" / "modeling_other.py.diff").mkdir()
    with pytest.raises(PatchgenError, match=r"modeling_other.py.diff: is a directory"):
        write_atomic(new_files, confinement(load_config(root)))
    (root / "generated" / "other" / "modeling_other.py.diff").rmdir()
    assert state(root) == {k: v for k, v in old.items() if not k.endswith("other/modeling_other.py.diff")}
    assert not (root / TXN_DIR).exists()


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=oct)
def test_written_files_get_their_mode_from_the_umask(project, umask) -> None:
    root, new_files, _, _ = old_and_new(project)
    previous = os.umask(umask)
    try:
        write_atomic(new_files, confinement(load_config(root)))
    finally:
        os.umask(previous)
    for path in new_files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_a_staging_leftover_without_a_journal_is_discarded(project) -> None:
    root, new_files, old, _ = old_and_new(project)
    (root / TXN_DIR).mkdir()
    (root / TXN_DIR / "0.new").write_text("half")
    assert recover(root) == "discarded"
    assert state(root) == old and not (root / TXN_DIR).exists()
    assert recover(root) is None


def test_the_staging_directory_ignores_itself() -> None:
    assert files.GITIGNORE == "*\n"  # git then ignores the directory in any repository, with no .gitignore edit


def test_a_journal_naming_paths_outside_the_project_is_refused(project, tmp_path) -> None:
    root, _, old, _ = old_and_new(project)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (root / TXN_DIR).mkdir()
    (root / TXN_DIR / "0.new").write_text("owned\n")
    journal = {"entries": [{"target": "../victim.txt", "new": "0.new", "old": None}], "dirs": []}
    (root / TXN_DIR / "journal.json").write_text(json.dumps(journal))
    with pytest.raises(
        PatchgenError, match=r"refused to replay an interrupted write: entry 0 is not a plain relative"
    ):
        recover(root)
    assert victim.read_text() == "keep me\n" and state(root) == old


def test_a_write_through_a_symlinked_folder_is_refused_before_anything_is_staged(project) -> None:
    """A journal of such a write could never be replayed (recovery writes through no symlink), so the write itself
    refuses it: the output's folder is a link to another folder of generated/."""
    proj = project(spec_toml(output="generated/link/modeling_toy.py"))
    (proj.root / "generated" / "real").mkdir(parents=True)
    (proj.root / "generated" / "link").symlink_to("real", target_is_directory=True)
    with pytest.raises(PatchgenError, match=r"cannot write generated/link/\S+: 'generated/link' is a symlink"):
        regen(proj.config, load_specs(proj.config, None), source=FixtureSource())
    assert list((proj.root / "generated" / "real").iterdir()) == [] and not (proj.root / TXN_DIR).exists()
