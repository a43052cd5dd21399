"""`patchgen upgrade --migrate` on synthetic before/after upstream modules (one rule per test), and once end to end
on the cached transformers 5.23.0 wheel.

Every expected edit is written here by hand from the two module texts; the proposed diff is applied with `git apply`
(not by patchgen) before the migrated spec is regenerated.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from patchgen.migrate import Migration, migrate
from patchgen.spec_set import load_specs
from patchgen.upgrade import analyze, baseline_source
from patchgen.upstream import WheelSource, read_wheel
from patchgen.wheels import obtain_all, wheel_cache
from tests.engine.helpers import REPO, TOY, FixtureSource, build_wheel, make_project, record_wheel, run_cli, spec_toml

OLD_V, NEW_V = "1.5.0", "2.0.0"
OLD = '''"""Migration fixture."""
from typing import Optional


def head(x):
    return list(x)


def trim(x):
    return x[:-1]


class Block:
    def forward(self, hidden):
        residual = hidden
        hidden = [h * 2 for h in hidden]
        return [h + r for h, r in zip(hidden, residual)]


class Net:
    def __init__(self):
        self.block = Block()

    def forward(self, hidden):
        keep = len(hidden) - 1
        scale: Optional[float] = None
        hidden = self.block.forward(hidden)
        out = head(hidden[:keep])
        return out
'''
# the head slice moved into a helper: `keep` is gone and the head reads the trimmed hidden states
MOVED = OLD.replace("        keep = len(hidden) - 1\n", "").replace(
    "out = head(hidden[:keep])", "hidden = trim(hidden)\n        out = head(hidden)"
)
HEAD_VAR = """{#
op = "replace"
doc = "the head call, with what it reads as a variable (test)"
reimplements = ["out = head("]

[vars.hidden]
kind = "expr"
default = "hidden[:keep]"
doc = "what the head reads"
#}
out = head({{ hidden }}) + []
"""
HEAD_FIXED = """{#
op = "replace"
doc = "the head call, with what it reads written in the template (test)"
reimplements = ["out = head("]
#}
out = head(hidden[:keep]) + []
"""
HEAD = dict(scope="Net.forward", anchor="out = head(hidden[:keep])", why="the head")
PROBE = dict(template="fx/insert_code", vars=dict(code="probe"), why="a probe")


def setup(root: Path, new: str, patches: list[dict]):
    """A project pinned to fixturepkg 1.5.0 (OLD) with the 2.0.0 wheel (`new`) cached and trusted."""
    proj = make_project(root, spec_toml(keep=["Net"], patches=patches), pins={"fixturepkg": OLD_V})
    (proj.root / "templates" / "mig").mkdir()
    (proj.root / "templates" / "mig" / "head_var.py.j2").write_text(HEAD_VAR)
    (proj.root / "templates" / "mig" / "head_fixed.py.j2").write_text(HEAD_FIXED)
    cache = wheel_cache(proj.root)
    record_wheel(proj.root, build_wheel(cache, OLD_V, {TOY: OLD}))
    wheel = build_wheel(cache, NEW_V, {TOY: new})
    record_wheel(proj.root, wheel)
    return proj, read_wheel(wheel)


def run(tmp_path: Path, new: str, patches: list[dict]) -> Migration:
    proj, wheel = setup(tmp_path / "proj", new, patches)
    old = FixtureSource(OLD_V, {TOY: OLD})
    upgrade = analyze(proj.config, load_specs(proj.config, None), [wheel], old)
    return migrate(proj.config, upgrade, old, WheelSource([wheel]))


def edits(migration: Migration) -> dict[tuple[int, str], tuple[str | None, str]]:
    return {(e.table, e.key): (e.old, e.new) for o in migration.outcomes for e in o.edits}


def left(migration: Migration) -> dict[int, str]:
    return {o.status.patch.index: o.reason for o in migration.outcomes if not o.edits}


def counts(migration: Migration) -> tuple[int, int]:
    return migration.before[0], migration.after[0]


def test_moved_anchor_is_migrated_with_the_argument_its_template_var_reproduced(tmp_path, capsys) -> None:
    patches = [dict(template="mig/head_var", **HEAD)]
    proj, _ = setup(tmp_path / "proj", MOVED, patches)
    spec = proj.root / "specs" / "toy.toml"
    before = spec.read_bytes()
    code, out, err = run_cli(proj.root, capsys, "upgrade", "--to", f"fixturepkg=={NEW_V}", "--migrate")
    assert code == 1, err  # the pinned specs still do not apply: --migrate only proposes
    assert "migration: 0 of 1 patches apply with the pinned specs, 1 with the migrated ones" in out
    assert spec.read_bytes() == before
    review = proj.root / "upgrade-review" / f"fixturepkg-{NEW_V}"
    report = (review / "REPORT.md").read_text()
    assert "### Proposed edits" in report and "rule 1 (moved anchor)" in report

    # the diff, applied by git, is exactly the intended edit; the migrated spec regenerates against 2.0.0
    subprocess.run(["git", "apply", str(review / "specs.diff")], cwd=proj.root, check=True)
    [table] = tomllib.loads(spec.read_text())["patch"]
    assert table["anchor"] == "out = head(hidden)" and table["vars"] == {"hidden": "hidden"}
    assert table["scope"] == "Net.forward" and table["why"] == "the head"
    text = proj.generate("toy", FixtureSource(NEW_V, {TOY: MOVED})).text
    assert "out = head(hidden) + []" in text and "keep" not in text
    compile(text, "modeling_toy.py", "exec")

    # --apply-specs writes the same bytes git produced; it needs --migrate
    applied = spec.read_bytes()
    spec.write_bytes(before)
    code, _, _ = run_cli(proj.root, capsys, "upgrade", "--to", f"fixturepkg=={NEW_V}", "--migrate", "--apply-specs")
    assert code == 1 and spec.read_bytes() == applied
    code, _, err = run_cli(proj.root, capsys, "upgrade", "--to", f"fixturepkg=={NEW_V}", "--apply-specs")
    assert code == 2 and "pass --migrate too" in err and "Traceback" not in err


def test_an_inherited_patch_is_migrated_once_in_its_base_spec(tmp_path) -> None:
    proj, wheel = setup(tmp_path / "proj", MOVED, [dict(template="mig/head_var", **HEAD)])
    proj.write_spec(f'extends = "toy"\nmodule = "{TOY}"\noutput = "generated/child/modeling_toy.py"\n', "child")
    old = FixtureSource(OLD_V, {TOY: OLD})
    upgrade = analyze(proj.config, load_specs(proj.config, None), [wheel], old)
    migration = migrate(proj.config, upgrade, old, WheelSource([wheel]))
    assert {o.model: [(e.path.name, e.table, e.key) for e in o.edits] for o in migration.outcomes} == {
        "child": [("toy.toml", 1, "anchor"), ("toy.toml", 1, "vars.hidden")],
        "toy": [("toy.toml", 1, "anchor"), ("toy.toml", 1, "vars.hidden")],
    }
    assert list(migration.texts) == [proj.root / "specs" / "toy.toml"] and migration.diff.count("+++ ") == 1
    assert (migration.before, migration.after) == ((0, 2), (2, 2))


def test_template_reading_a_local_upstream_removed_is_left(tmp_path) -> None:
    migration = run(tmp_path, MOVED, [dict(template="mig/head_fixed", **HEAD)])
    assert edits(migration) == {} and migration.texts == {} and migration.diff == ""
    assert "the template reads keep, which the old scope bound and the new one does not" in left(migration)[1]
    assert counts(migration) == (0, 0)


def test_reformatted_anchor_is_migrated_and_whitespace_alone_needs_nothing(tmp_path) -> None:
    new = OLD.replace("scale: Optional[float] = None", "scale: float | None = None").replace(
        "hidden = self.block.forward(hidden)", "hidden = self.block.forward(\n            hidden,\n        )"
    )
    patches = [
        dict(scope="Net.forward", after="scale: Optional[float] = None", **PROBE),
        dict(scope="Net.forward", after="hidden = self.block.forward(hidden)", **PROBE),
    ]
    migration = run(tmp_path, new, patches)
    assert edits(migration) == {(1, "after"): ("scale: Optional[float] = None", "scale: float | None = None")}
    assert "equal after normalising formatting and typing spellings" in migration.outcomes[0].reason
    assert counts(migration) == (1, 2)


def test_two_equally_near_candidates_are_left_to_the_human(tmp_path) -> None:
    branches = (
        "if keep:\n            out = head(hidden[:keep + 1])\n        else:\n            out = head(hidden[:keep - 1])"
    )
    new = OLD.replace("out = head(hidden[:keep])", branches)
    migration = run(tmp_path, new, [dict(template="mig/head_var", **HEAD)])
    assert edits(migration) == {} and migration.diff == ""
    assert left(migration)[1] == (
        "anchor: 2 candidates are equally eligible: `out = head(hidden[:keep + 1])`; `out = head(hidden[:keep - 1])`"
        "; rule 3: `out` is bound 2 times in the scope"  # rule 3 tried too (test_migrate_rules.py)
    )
    assert counts(migration) == (0, 0)


def test_a_statement_of_another_kind_is_left(tmp_path) -> None:
    new = OLD.replace("out = head(hidden[:keep])", "out: list = head(hidden[:keep])")  # Assign -> AnnAssign
    migration = run(tmp_path, new, [dict(template="mig/head_var", **HEAD)])
    assert edits(migration) == {}
    assert left(migration)[1].startswith("anchor: no statement of its kind has the same meaning")


def test_a_renamed_class_is_followed_when_unique(tmp_path) -> None:
    new = OLD.replace("Block", "DecoderBlock")
    migration = run(tmp_path, new, [dict(scope="Block.forward", after="residual = hidden", **PROBE)])
    assert edits(migration) == {(1, "scope"): ("Block.forward", "DecoderBlock.forward")}
    assert migration.outcomes[0].reason.startswith("rule 2 (moved scope)")
    assert counts(migration) == (0, 1)


def test_an_ambiguous_rename_is_left(tmp_path) -> None:
    block = OLD[OLD.index("class Block:") : OLD.index("class Net:")]
    new = OLD.replace(block, block.replace("Block", "BlockA") + block.replace("Block", "BlockB")).replace(
        "Block()", "BlockA()"
    )
    migration = run(tmp_path, new, [dict(scope="Block.forward", after="residual = hidden", **PROBE)])
    assert edits(migration) == {}
    assert "BlockA.forward, BlockB.forward, not in exactly one other definition" in left(migration)[1]


# the transformers specs when the 5.23.0 migration was made (docs/upgrades/transformers-5.23.0.md)
COVERED_5_23_0 = (
    *("llama", "qwen2", "qwen2_5_vl", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_moe", "qwen3_omni_moe"),
    *("qwen3_omni_moe_processor", "qwen3_vl", "qwen3_vl_moe"),
)


@pytest.mark.slow
def test_transformers_5_23_0_more_patches_apply_after_migration() -> None:
    """The cached wheel (a clean clone downloads it once). Every migrated edit is one TOML value of a spec file."""
    from patchgen.config import load_config

    config = load_config(REPO)
    cache = wheel_cache(config.root)
    wheels = [w for w, _ in obtain_all(["transformers==5.23.0"], config.pins, cache, "--to", config.wheel_sha256)]
    baseline, _ = baseline_source(config, {"transformers"}, cache)
    specs = [s for s in load_specs(config, None) if s.name in COVERED_5_23_0]  # specs added later: not counted
    upgrade = analyze(config, specs, wheels, baseline)
    migration = migrate(config, upgrade, baseline, WheelSource(wheels))
    (before, total), (after, _) = migration.before, migration.after
    assert (before, total) == (108, 159) and after == 157  # the two left: the processor's inputs (hand edits)
    # qwen2 inherits its head patch from qwen3: the one edit lands in qwen3.toml and serves both
    qwen3 = {
        (e.path.name, e.table, e.key, e.old, e.new)
        for o in migration.outcomes
        if o.model in ("qwen2", "qwen3")
        for e in o.edits
    }
    assert qwen3 == {
        (
            "qwen3.toml",
            5,
            "anchor",
            "logits = self.lm_head(hidden_states[:, slice_indices, :])",
            "logits = self.lm_head(hidden_states)",
        ),
        ("qwen3.toml", 5, "vars.hidden", None, "hidden_states"),
    }
    for path, text in migration.texts.items():
        assert tomllib.loads(text)["patch"] != tomllib.loads(path.read_text())["patch"]
    assert not any(p.name.startswith(".migrate-") for p in (config.root / "upgrade-review").iterdir())


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    """No network for the fixture projects: their wheels are in their caches."""
    from patchgen import wheels

    def refuse(package: str, version: str, cache: Path) -> Path:
        if package == "transformers":  # the end-to-end check may download its wheel on a clean clone
            return real(package, version, cache)
        raise AssertionError(f"unexpected download of {package}=={version}")

    real = wheels.download_wheel
    monkeypatch.setattr(wheels, "download_wheel", refuse)
