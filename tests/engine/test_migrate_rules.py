"""Migration rules 3-5 (patchgen/migrate_rules/), each on a synthetic before/after pair of one upstream module: the
edit a rule proposes is written here by hand from the two texts, and a near miss of each rule is left to the human.
Rules 1 and 2 are tested in test_migrate.py."""

from __future__ import annotations

from pathlib import Path

from patchgen.migrate import Migration, migrate
from patchgen.spec_set import load_specs
from patchgen.upgrade import analyze
from patchgen.upstream import WheelSource, read_wheel
from patchgen.wheels import wheel_cache
from tests.engine.helpers import TOY, FixtureSource, build_wheel, make_project, record_wheel, spec_toml

OLD_V, NEW_V = "1.5.0", "2.0.0"
OLD = '''"""Rules fixture."""


class Inner:
    def forward(self, hidden, pixels=None):
        return hidden


class Net:
    _units = ["Inner"]

    def __init__(self):
        self.inner = Inner()

    def forward(self, hidden, pixels=None):
        keep = len(hidden) - 1
        if pixels is not None:
            hidden = hidden + pixels
        out = sum(hidden[:keep])
        return out
'''
BODY = OLD[OLD.index("        keep = len(hidden) - 1") : OLD.index("        return out")]
# the template re-implements the whole `{{ target }} =` statement, whatever upstream computes it with
WHOLE = """{#
op = "replace"
doc = "the result, computed by the template (test)"
reimplements = ["{{ target }} ="]

[vars.target]
kind = "identifier"
doc = "what upstream assigns"
#}
{{ target }} = sum(hidden[:keep]) + 0
"""
UNITS = """{#
op = "replace"
doc = "the class's units, declared by the template (test)"
reimplements = ["_units ="]
#}
_units = ["Inner"]
"""
PARTIAL = WHOLE.replace('["{{ target }} ="]', '["{{ target }} = sum("]')
PROBE = dict(template="fx/insert_code", scope="Net.forward", vars=dict(code="probe"), why="a probe")


def run(tmp_path: Path, new: str, patches: list[dict]) -> Migration:
    proj = make_project(tmp_path / "proj", spec_toml(keep=["Net"], patches=patches), pins={"fixturepkg": OLD_V})
    (proj.root / "templates" / "mig").mkdir()
    (proj.root / "templates" / "mig" / "whole.py.j2").write_text(WHOLE)
    (proj.root / "templates" / "mig" / "partial.py.j2").write_text(PARTIAL)
    (proj.root / "templates" / "mig" / "units.py.j2").write_text(UNITS)
    cache = wheel_cache(proj.root)
    record_wheel(proj.root, build_wheel(cache, OLD_V, {TOY: OLD}))
    wheel = build_wheel(cache, NEW_V, {TOY: new})
    record_wheel(proj.root, wheel)
    old = FixtureSource(OLD_V, {TOY: OLD})
    upgrade = analyze(proj.config, load_specs(proj.config, None), [read_wheel(wheel)], old)
    return migrate(proj.config, upgrade, old, WheelSource([read_wheel(wheel)]))


def edits(migration: Migration) -> dict[tuple[int, str], str]:
    return {(e.table, e.key): e.new for o in migration.outcomes for e in o.edits}


def reasons(migration: Migration) -> dict[int, str]:
    return {o.status.patch.index: o.reason for o in migration.outcomes}


# ---- rule 3: the same variable, bound by other code --------------------------------------------------------------


def test_an_insert_follows_its_variable_to_the_code_that_now_binds_it(tmp_path) -> None:
    new = OLD.replace("keep = len(hidden) - 1", "keep = max(len(hidden) - 1, 0)")  # no call before: not rule 1
    migration = run(tmp_path, new, [dict(after="keep = len(hidden) - 1", **PROBE)])
    assert edits(migration) == {(1, "after"): "keep = max(len(hidden) - 1, 0)"}
    assert reasons(migration)[1].startswith("rule 3 (same variable, other code): `keep` is bound once")
    assert migration.after == (1, 1)


def test_an_insert_goes_after_the_last_binding_of_the_scope_body(tmp_path) -> None:
    new = OLD.replace("keep = len(hidden) - 1", "keep = len(hidden)\n        keep = keep - 1")
    migration = run(tmp_path, new, [dict(after="keep = len(hidden) - 1", **PROBE)])
    assert edits(migration) == {(1, "after"): "keep = keep - 1"}


def test_a_variable_bound_in_branches_is_left(tmp_path) -> None:
    branches = "if hidden:\n            keep = 1\n        else:\n            keep = 0"
    migration = run(
        tmp_path, OLD.replace("keep = len(hidden) - 1", branches), [dict(after="keep = len(hidden) - 1", **PROBE)]
    )
    assert edits(migration) == {}
    assert "rule 3: `keep` is bound 2 times in the scope" in reasons(migration)[1]


def test_a_replace_follows_only_when_its_template_re_implements_the_whole_statement(tmp_path) -> None:
    new = OLD.replace("out = sum(hidden[:keep])", "out = max(hidden[:keep])")  # another callee: not rule 1
    head = dict(scope="Net.forward", anchor="out = sum(hidden[:keep])", vars=dict(target="out"), why="the result")
    migration = run(tmp_path, new, [dict(template="mig/whole", **head)])
    assert edits(migration) == {(1, "anchor"): "out = max(hidden[:keep])"}
    assert "the template re-implements the whole statement" in reasons(migration)[1]
    partial = run(tmp_path / "partial", new, [dict(template="mig/partial", **head)])
    assert edits(partial) == {}
    assert "rule 3: the template does not declare it re-implements `out =`" in reasons(partial)[1]


# ---- rule 4: the same branch under a condition with one conjunct more or fewer ------------------------------------


def test_an_insert_stays_before_the_branch_whose_condition_gained_a_conjunct(tmp_path) -> None:
    new = OLD.replace("if pixels is not None:", "if self.inner is not None and pixels is not None:")
    migration = run(tmp_path, new, [dict(before="if pixels is not None:", **PROBE)])
    assert edits(migration) == {(1, "before"): "if self.inner is not None and pixels is not None:"}
    assert reasons(migration)[1] == (
        "rule 4 (changed condition): the only `if` of the scope testing the old conditions + `self.inner is not None`"
    )


def test_two_branches_with_a_conjunct_more_are_left(tmp_path) -> None:
    two = "if hidden and pixels is not None:\n            hidden = hidden + pixels\n"
    two += "        if keep and pixels is not None:"
    migration = run(
        tmp_path, OLD.replace("if pixels is not None:", two), [dict(before="if pixels is not None:", **PROBE)]
    )
    assert edits(migration) == {}
    assert "rule 4: 2 `if` headers test one conjunct more or fewer" in reasons(migration)[1]


# ---- rule 5: code moved into the definition the old scope delegates to -------------------------------------------


def delegated(forward_calls: str) -> str:
    """The body of Net.forward moved into Inner.forward (its branch gained a conjunct), Net.forward calling
    `forward_calls`; the class attribute moved into Inner with one entry more."""
    new = OLD.replace(
        "        return hidden\n",
        BODY.replace("if pixels is not None:", "if pixels is not None and keep:") + "        return out\n",
    )
    new = new.replace(BODY, f"        out = {forward_calls}(hidden, pixels)\n")
    return new.replace('    _units = ["Inner"]\n\n', "").replace(
        "class Inner:\n", 'class Inner:\n    _units = ["Inner", "Net"]\n\n'
    )


def test_code_moved_into_the_delegate_is_followed_there(tmp_path) -> None:
    unit = dict(template="mig/units", scope="Net", anchor='_units = ["Inner"]', why="the units")
    patches = [dict(after="keep = len(hidden) - 1", **PROBE), dict(before="if pixels is not None:", **PROBE), unit]
    migration = run(tmp_path, delegated("self.inner"), patches)
    assert edits(migration) == {
        (1, "scope"): "Inner.forward",
        (2, "scope"): "Inner.forward",
        (2, "before"): "if pixels is not None and keep:",
        (3, "scope"): "Inner",
        (3, "anchor"): "_units = ['Inner', 'Net']",
    }
    assert (
        reasons(migration)[1] == "rule 5 (moved into the delegate `Inner.forward`): the unchanged anchor matches once"
    )
    assert reasons(migration)[2].startswith("rule 5 (moved into the delegate `Inner.forward`): rule 4 (changed")


def test_a_scope_that_does_not_call_its_delegate_is_left(tmp_path) -> None:
    migration = run(tmp_path, delegated("sum"), [dict(after="keep = len(hidden) - 1", **PROBE)])
    assert edits(migration) == {}
    assert "the unchanged anchor is now in Inner.forward (the old scope still exists)" in reasons(migration)[1]
