"""`patchgen upgrade --with-specs DIR`: a reviewed migration (hand edits the rules cannot make) kept outside specs/,
read in place of the spec files of the same names; the rules migrate the rest on top. specs/ is written only by
`--migrate --apply-specs`, and a file that changes more than a migration may is refused."""

from __future__ import annotations

import tomllib
from pathlib import Path

from patchgen.wheels import wheel_cache
from tests.engine.helpers import TOY, build_wheel, make_project, record_wheel, run_cli, spec_toml
from tests.engine.test_migrate_rules import NEW_V, OLD, OLD_V, PROBE

# upstream 2.0.0: the branch a probe went before is gone (a hand edit), the variable another went after is bound by
# other code (rule 3 migrates it)
NEW = OLD.replace(
    "if pixels is not None:\n            hidden = hidden + pixels\n", "hidden = hidden + (pixels or 0)\n"
)
NEW = NEW.replace("keep = len(hidden) - 1", "keep = max(len(hidden) - 1, 0)")
PATCHES = [dict(before="if pixels is not None:", **PROBE), dict(after="keep = len(hidden) - 1", **PROBE)]
HAND = [dict(PATCHES[0], before="hidden = hidden + (pixels or 0)"), PATCHES[1]]


def project(tmp_path: Path, hand: list[dict] = HAND) -> tuple[Path, Path]:
    proj = make_project(tmp_path / "proj", spec_toml(keep=["Net"], patches=PATCHES), pins={"fixturepkg": OLD_V})
    cache = wheel_cache(proj.root)
    record_wheel(proj.root, build_wheel(cache, OLD_V, {TOY: OLD}))
    record_wheel(proj.root, build_wheel(cache, NEW_V, {TOY: NEW}))
    folder = proj.root / "reviewed"
    folder.mkdir()
    (folder / "toy.toml").write_text("# HAND EDIT: the branch is gone\n" + spec_toml(keep=["Net"], patches=hand))
    return proj.root, folder


def test_the_reviewed_files_and_the_rules_together_make_every_patch_apply(tmp_path, capsys) -> None:
    root, folder = project(tmp_path)
    spec = root / "specs" / "toy.toml"
    before = spec.read_text()
    upgrade = ("upgrade", "--to", f"fixturepkg=={NEW_V}")
    code, out, err = run_cli(root, capsys, *upgrade, "--migrate")
    assert code == 1 and "0 of 2 patches apply with the pinned specs, 1 with the migrated ones" in out, err
    code, out, err = run_cli(root, capsys, *upgrade, "--with-specs", str(folder), "--migrate")
    assert "1 of 2 patches apply with the pinned specs, 2 with the migrated ones" in out, err
    review = root / "upgrade-review" / f"fixturepkg-{NEW_V}"
    diff = (review / "specs.diff").read_text()
    assert "+# HAND EDIT: the branch is gone" in diff and '+after = "keep = max(len(hidden) - 1, 0)"' in diff
    assert "This run read specs/ with toy.toml replaced by" in (review / "REPORT.md").read_text()
    assert spec.read_text() == before and not list((root / "upgrade-review").glob(".with-specs-*"))

    code, out, err = run_cli(root, capsys, *upgrade, "--with-specs", str(folder), "--migrate", "--apply-specs")
    written = [p["before"] if "before" in p else p["after"] for p in tomllib.loads(spec.read_text())["patch"]]
    assert written == ["hidden = hidden + (pixels or 0)", "keep = max(len(hidden) - 1, 0)"], err
    code, out, err = run_cli(root, capsys, *upgrade)
    assert code == 0 and "2 of 2 patches apply" in out, out + err


def test_a_file_changing_more_than_a_migration_may_or_replacing_no_spec_is_refused(tmp_path, capsys) -> None:
    root, folder = project(tmp_path, [dict(HAND[0], why="reworded"), HAND[1]])
    upgrade = ("upgrade", "--to", f"fixturepkg=={NEW_V}", "--with-specs", str(folder))
    code, _, err = run_cli(root, capsys, *upgrade)
    assert code == 2 and "the migrated spec changes patch 1: key 'why'" in err
    (folder / "toy.toml").rename(folder / "other.toml")
    code, _, err = run_cli(root, capsys, *upgrade)
    assert code == 2 and "other.toml replace(s) no spec of" in err
    code, _, err = run_cli(root, capsys, *upgrade, "--apply")
    assert code == 2 and "apply the --with-specs files first (--apply-specs)" in err
    assert not list((root / "upgrade-review").glob(".with-specs-*"))
