"""Property tests: patches touch their marked regions and nothing else, byte for byte.

The upstream is fixturepkg/plain.py: no relative imports, and the specs keep every definition, so the only
differences from upstream are the patched regions (and the provenance header).
"""

from __future__ import annotations

import libcst as cst
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from patchgen.cst.locate import code_of, iter_statements, normalize, normalize_anchor, statement_key
from patchgen.cst.scopes import find_scope
from patchgen.errors import PatchgenError
from tests.engine.helpers import (
    PLAIN,
    FixtureSource,
    body_of,
    drop_statements,
    make_project,
    spec_toml,
    strip_marked,
    upstream_text,
)
from tests.engine.snippets import SNIPPETS

UPSTREAM = upstream_text(PLAIN)
MODULE = cst.parse_module(UPSTREAM)
KEEP = ["memo", "fib", "pairs", "Counter", "os_devnull"]
SCOPES = ["<module>", "fib", "pairs", "Counter", "Counter.__init__", "Counter.add", "Counter.reset", "os_devnull"]
# database=None: no .hypothesis/ directory in the repository; modest example counts keep the suite fast.
SETTINGS = settings(
    max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def anchor_text(stmt: cst.BaseStatement) -> str:
    """What a spec author would write: a simple statement as is, a compound statement by its header."""
    if isinstance(stmt, cst.BaseCompoundStatement):
        bare = stmt.with_changes(leading_lines=[])
        if isinstance(bare, cst.FunctionDef | cst.ClassDef):
            bare = bare.with_changes(decorators=[])
        return code_of(bare).strip().splitlines()[0]
    return code_of(stmt.with_changes(leading_lines=[])).strip()


def statement_candidates() -> list[tuple[str, str, cst.BaseStatement]]:
    """(scope, anchor, upstream statement) for every statement whose key is unique in its scope."""
    out = []
    for scope in SCOPES:
        node = find_scope(MODULE, scope)
        # module scope: its top-level statements only (nested ones are reached through narrower scopes)
        statements = MODULE.body if scope == "<module>" else list(iter_statements(node))
        keys = [statement_key(s) for s in (iter_statements(node) if scope == "<module>" else statements)]
        for stmt in statements:
            key = statement_key(stmt)
            if keys.count(key) == 1:
                assert normalize_anchor(anchor_text(stmt)) == key, anchor_text(stmt)  # the anchor names it
                out.append((scope, anchor_text(stmt), stmt))
    return out


def run_candidates() -> list[tuple[str, str, str, list[cst.BaseStatement]]]:
    """(scope, anchor, through, statements) for runs of 2-3 sibling statements, both ends unique anchors."""
    blocks = [list(MODULE.body)]
    stack = [MODULE]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if isinstance(node, cst.IndentedBlock):
            blocks.append(list(node.body))
    anchors = {id(stmt): (scope, anchor) for scope, anchor, stmt in STATEMENTS}
    out = []
    for block in blocks:
        for i, first in enumerate(block):
            for last in block[i + 1 : i + 3]:
                if id(first) in anchors and id(last) in anchors and anchors[id(first)][0] == anchors[id(last)][0]:
                    run = block[i : block.index(last) + 1]
                    out.append((anchors[id(first)][0], anchors[id(first)][1], anchors[id(last)][1], run))
    return out


def innermost_statements() -> dict[int, cst.BaseStatement]:
    """id(expression) -> the innermost statement holding it (what a wrap marker marks)."""
    table: dict[int, cst.BaseStatement] = {}

    def walk(node: cst.CSTNode, holder: cst.BaseStatement | None) -> None:
        for child in node.children:
            table[id(child)] = holder
            walk(child, child if isinstance(child, cst.BaseStatement) else holder)

    walk(MODULE, None)
    return table


def call_candidates() -> list[tuple[str, str, cst.Call, cst.BaseStatement]]:
    """(scope, anchor, call, its statement) for every call whose normalized text is unique in its scope."""
    holders = innermost_statements()
    out, seen = [], set()
    for scope in SCOPES[1:]:
        stack, calls = [find_scope(MODULE, scope)], []
        while stack:
            current = stack.pop()
            stack.extend(current.children)
            if isinstance(current, cst.Call):
                calls.append((normalize(code_of(current), "eval"), current))
        keys = [key for key, _ in calls]
        for key, call in calls:
            if keys.count(key) == 1 and id(call) not in seen:
                out.append((scope, code_of(call).strip(), call, holders[id(call)]))
                seen.add(id(call))
    return out


STATEMENTS = statement_candidates()
RUNS = run_candidates()
CALLS = call_candidates()


def test_the_fixture_offers_enough_anchors() -> None:
    assert len(STATEMENTS) >= 30 and len(RUNS) >= 10 and len(CALLS) >= 10
    anchors = {anchor for _, anchor, _ in STATEMENTS}
    # compound headers of every kind are usable anchors
    for header in (
        "def fib(n):",
        "if n < 2:",
        "for i, (a, b) in enumerate(itertools.pairwise(items)):",
        "while self.value > LIMIT:",
        "try:",
        "with open(os_devnull()) as handle:",
        "class Counter:",
    ):
        assert header in anchors, header


@pytest.fixture(scope="module")
def plain_project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("props"))


def generate(proj, patches: list[dict]) -> str:
    proj.write_spec(spec_toml(module=PLAIN, output="generated/plain.py", keep=KEEP, patches=patches))
    return body_of(proj.generate(source=FixtureSource()).text)


inserts = st.lists(
    st.tuples(
        st.integers(0, len(STATEMENTS) - 1), st.sampled_from(["before", "after"]), st.integers(0, len(SNIPPETS) - 1)
    ),
    min_size=1,
    max_size=5,
)


@SETTINGS
@given(inserts)
def test_removing_marked_insert_regions_gives_back_upstream(plain_project, picks) -> None:
    patches = [
        dict(
            template="fx/insert_code",
            scope=STATEMENTS[i][0],
            **{where: STATEMENTS[i][1]},
            vars=dict(code=f"snippet_{s}"),
            why=f"probe {n}",
        )
        for n, (i, where, s) in enumerate(picks)
    ]
    body = generate(plain_project, patches)
    compile(body, "plain.py", "exec")
    assert body.count("# patchgen #") == len(patches)
    assert strip_marked(body) == UPSTREAM


edits = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, len(STATEMENTS) - 1),
            st.sampled_from(["before", "after"]),
            st.integers(0, len(SNIPPETS) - 1),
        ),
        st.tuples(
            st.just("replace"),
            st.integers(0, len(STATEMENTS) - 1),
            st.just("anchor"),
            st.integers(0, len(SNIPPETS) - 1),
        ),
        st.tuples(st.just("wrap"), st.integers(0, len(CALLS) - 1), st.just("anchor"), st.just(0)),
        st.tuples(st.just("run"), st.integers(0, len(RUNS) - 1), st.just("anchor"), st.integers(0, len(SNIPPETS) - 1)),
    ),
    min_size=1,
    max_size=5,
)


@SETTINGS
@given(edits)
def test_everything_outside_replace_and_wrap_regions_is_byte_identical(plain_project, picks) -> None:
    patches, touched = [], []
    for n, (kind, i, key, s) in enumerate(picks):
        if kind == "wrap":
            scope, anchor, _, holder = CALLS[i]
            patches.append(dict(template="fx/wrap_guard", scope=scope, anchor=anchor, why=f"wrap {n}"))
            touched.append(holder)
        elif kind == "run":
            scope, anchor, through, run = RUNS[i]
            patches.append(
                dict(
                    template="fx/replace_code",
                    scope=scope,
                    anchor=anchor,
                    through=through,
                    vars=dict(code=f"snippet_{s}"),
                    why=f"run {n}",
                )
            )
            touched.extend(run)
        else:
            scope, anchor, stmt = STATEMENTS[i]
            template = "fx/insert_code" if kind == "insert" else "fx/replace_code"
            patches.append(
                dict(
                    template=template, scope=scope, **{key: anchor}, vars=dict(code=f"snippet_{s}"), why=f"{kind} {n}"
                )
            )
            if kind == "replace":
                touched.append(stmt)
    try:
        body = generate(plain_project, patches)
    except PatchgenError as exc:
        assume("conflicts with patch" not in str(exc))  # a replaced statement edited by another patch
        raise
    compile(body, "plain.py", "exec")
    assert strip_marked(body) == drop_statements(MODULE, touched)


class _Unwrap(cst.CSTTransformer):
    def leave_Call(self, original, updated):
        if isinstance(updated.func, cst.Name) and updated.func.value == "guard":
            return updated.args[0].value
        return updated


@settings(SETTINGS, max_examples=10)
@given(st.lists(st.integers(0, len(CALLS) - 1), min_size=1, max_size=4, unique=True))
def test_unwrapping_wraps_gives_back_upstream(plain_project, picks) -> None:
    patches = [
        dict(template="fx/wrap_guard", scope=CALLS[i][0], anchor=CALLS[i][1], why=f"w{n}") for n, i in enumerate(picks)
    ]
    body = generate(plain_project, patches)
    assert body.count("guard(") == len(picks)
    unwrapped = cst.parse_module(body).visit(_Unwrap()).code
    lines = [
        line
        for line in unwrapped.splitlines(keepends=True)
        if not line.lstrip().startswith("# patchgen ") and line != "from fixturepkg.extra import guard\n"
    ]
    assert "".join(lines) == UPSTREAM
