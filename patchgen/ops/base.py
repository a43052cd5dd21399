"""What every operation shares: the edit record, the resolve and rewrite contexts, and how a patch fails.

An operation (one module each under `patchgen/ops/`) owns the spec keys it takes, how a patch of its kind resolves
to the upstream node it edits, and how the edit is applied during the single libcst rewrite. The engine around it
(`patchgen.cst.plan`, `patchgen.cst.transform`) only orders, detects conflicts and walks the tree.

libcst is imported lazily here (`cst` below), so loading a spec, which asks each operation which keys it takes, stays
free of it: `patchgen check` proves freshness from hashes in well under a second.
"""

from __future__ import annotations

import ast
import importlib
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from patchgen.cst.locate import NodeIndex


class PatchTemplate(Protocol):
    """What an op needs of a patch's template (``patchgen.templates.Template``)."""

    name: str

    def render(self, values: dict[str, Any], builtins: dict[str, str] | None = None) -> str: ...


class Patch(Protocol):
    """What an op reads of a spec's patch (``patchgen.spec.Patch``, which satisfies it). A protocol rather than an
    import so that the op modules, which `patchgen.spec` and `patchgen.templates` ask for their keys, do not import
    them back (no import cycle)."""

    index: int
    template: PatchTemplate
    scope: str
    why: str
    vars: dict[str, Any]
    before: str | None
    after: str | None
    anchor: str | None
    through: str | None
    source: str
    module: str

    @property
    def label(self) -> str: ...

    @property
    def where(self) -> str: ...

    @property
    def anchor_text(self) -> str | None: ...


class LazyModule:
    """A module imported on first attribute access (then its namespace is copied here: later lookups are direct)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self.__dict__.update(vars(module))
        return getattr(module, attr)


cst: Any = LazyModule("libcst")
locate: Any = LazyModule("patchgen.cst.locate")  # each of these imports libcst
scopes: Any = LazyModule("patchgen.cst.scopes")
statement_anchors: Any = LazyModule("patchgen.cst.statement_anchors")
expression_anchors: Any = LazyModule("patchgen.cst.expression_anchors")

# PlanError.kind: why a patch does not apply (the upgrade report's status column). The locate kinds come first.
SCOPE_MISSING = "scope missing"  # no definition named like a part of the scope
SCOPE_AMBIGUOUS = "scope ambiguous"  # several definitions with that name
ANCHOR_MOVED = "anchor moved"  # the anchor matches nothing in its scope (the nearest candidates are given)
ANCHOR_AMBIGUOUS = "anchor ambiguous"  # the anchor matches several times
INVALID_ANCHOR = "invalid anchor"  # the anchor text is not a statement / expression: a spec error
CONFLICT = "conflict"  # it edits code another patch replaces, or adds a method upstream now defines
SCOPE_MISMATCH = "scope mismatch"  # the scope is not the kind of definition the op needs (e.g. a class)
RENDER_ERROR = "render error"  # the template does not render, or renders invalid Python
SPEC_ERROR = "spec error"  # the patch's keys do not fit its op, whatever upstream says
KINDS = (
    SCOPE_MISSING,
    SCOPE_AMBIGUOUS,
    ANCHOR_MOVED,
    ANCHOR_AMBIGUOUS,
    INVALID_ANCHOR,
    CONFLICT,
    SCOPE_MISMATCH,
    RENDER_ERROR,
    SPEC_ERROR,
)


class PlanError(Exception):
    """A patch that does not apply; `kind` (one of KINDS) says why, `candidates` are the nearest upstream matches."""

    def __init__(self, patch: Patch, message: str, candidates: list | None = None, kind: str = SPEC_ERROR) -> None:
        super().__init__(message)
        self.patch = patch
        self.message = message
        self.candidates = candidates or []
        self.kind = kind


@dataclass(frozen=True)
class Edit:
    """One change a patch makes: `op` applies it to `target` (a node of the pristine upstream tree)."""

    patch: Patch
    op: Op
    target: Any  # cst.CSTNode
    code: str  # rendered template body ("" for wrap, rendered per use; the new name for rename)
    span: tuple = ()  # replace with `through`: the further statements the replacement removes
    where: str = ""  # op detail: "before" / "after" for inserts

    @property
    def replaces_target(self) -> bool:
        """Whether the target is replaced wholesale (nothing inside it may be edited by another patch)."""
        return self.op.replaces


@dataclass
class Splice:
    """What a statement becomes: statements before it, the statement (or its replacement), statements after it."""

    before: list = field(default_factory=list)
    middle: list = field(default_factory=list)
    after: list = field(default_factory=list)


MARKER_PREFIX = "# patchgen "


def marker_text(label: str, count: int, why: str) -> str:
    return f"{MARKER_PREFIX}{label} ({count} stmt): {why}"


def patch_label(patch: Patch) -> str:
    return f"#{patch.index} {patch.template.name}"


def syntax_problem(code: str, exc: Exception) -> str:
    """`line L, column C: <message> in '<the rendered line>'`, one line, for code libcst cannot parse. Python's parser
    words it (libcst's message lists every token it expected, over several lines, with a caret drawing)."""
    try:
        ast.parse(code)
        line, column = getattr(exc, "raw_line", 1), getattr(exc, "raw_column", 0) + 1
        message = " ".join(str(getattr(exc, "message", exc)).split())  # Python accepts it: libcst is older
    except SyntaxError as err:
        line, column, message = err.lineno or 1, err.offset or 1, err.msg
    except (ValueError, RecursionError, MemoryError) as err:
        line, column, message = 1, 1, type(err).__name__
    lines = code.splitlines()
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    message = message if len(message) <= 200 else message[:197] + "..."
    return f"line {line}, column {column}: {message} in {text if len(text) <= 80 else text[:77] + '...'!r}"


def parse_statements(code: str, patch: Patch) -> list:
    """Rendered code -> statements; comments above the first statement stay with it."""
    code = textwrap.dedent(code)
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        where = getattr(patch.template, "path", patch.template.name)
        message = f"template {where} renders invalid Python: {syntax_problem(code, exc)}"
        empty = [name for name, value in sorted(patch.vars.items()) if value == []]
        if empty:  # what a newcomer who emptied a list sees: name the list, not only the rendered line
            message += f" (vars.{empty[0]} is an empty list: give it the items the template needs, or drop the patch)"
        raise PlanError(patch, message, kind=RENDER_ERROR) from exc
    body = list(module.body)
    if not body:
        raise PlanError(patch, "rendered template is empty", kind=RENDER_ERROR)
    header = list(module.header)  # comments above the first statement belong to it, not to a "file header"
    while header and header[0].comment is None:
        header.pop(0)
    return [body[0].with_changes(leading_lines=[*header, *body[0].leading_lines]), *body[1:]]


def defined_names(statements: list) -> list[str]:
    return [s.name.value for s in statements if isinstance(s, cst.ClassDef | cst.FunctionDef)]


def marked_block(patch: Patch, code: str, leading: list | None = None) -> list:
    """The rendered statements, the first one carrying the region's marker comment."""
    body = parse_statements(code, patch)
    marker = cst.EmptyLine(comment=cst.Comment(marker_text(patch_label(patch), len(body), patch.why)))
    first = body[0].with_changes(leading_lines=[*(leading or []), marker, *body[0].leading_lines])
    return [first, *body[1:]]


def put_beside(edit: Edit, splice: Splice, rewrite: Any) -> None:
    """The edit's rendered statements before or after the statement (inserts, anchored definitions)."""
    rewrite.count(edit)
    (splice.before if edit.where == "before" else splice.after).extend(marked_block(edit.patch, edit.code))


def put_over(edit: Edit, splice: Splice, rewrite: Any) -> None:
    """The edit's rendered statements instead of the statement, keeping its leading comments (replacements)."""
    rewrite.count(edit)
    splice.middle = marked_block(edit.patch, edit.code, leading=list(splice.middle[0].leading_lines))


@dataclass
class Resolution:
    """One patch's resolution: its edits and what generation needs to know about them."""

    edits: list[Edit] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)
    added_names: set[str] = field(default_factory=set)  # top-level definitions a patch writes: pruning roots
    rendered: list[str] = field(default_factory=list)  # every rendered body: its references keep definitions alive
    rendered_by: dict[int, list[str]] = field(default_factory=dict)  # the same, per patch index (name checks)
    chain_ids: set[int] = field(default_factory=set)  # definitions on the way down to a scope: the rewrite visits them
    path_ids: set[int] = field(default_factory=set)  # edited nodes and their ancestors: the rewrite visits these


@dataclass
class ResolveContext:
    """What an op's `resolve` works with: the pristine module, the shared node index, and the patch's resolution."""

    module: Any  # cst.Module
    index: NodeIndex
    patch: Patch
    out: Resolution
    scope: Any = None  # the node the patch's scope names (the module until scope_node() resolves it)

    def render(self, builtins: dict[str, str] | None = None) -> str:
        from patchgen.errors import PatchgenError

        try:
            site = {"scope": self.patch.scope, "spec": self.patch.source, "patch": str(self.patch.index)}
            code = self.patch.template.render(self.patch.vars, {**site, **(builtins or {})})
        except PatchgenError as exc:
            raise PlanError(self.patch, str(exc), kind=RENDER_ERROR) from exc
        self.out.rendered.append(code)
        self.out.rendered_by.setdefault(self.patch.index, []).append(code)
        return code

    def scope_node(self) -> Any:
        """The patch's scope (a class, function or the module), remembering the definitions on the way down."""
        chain = scopes.scope_chain(self.module, self.patch.scope)
        self.out.chain_ids.update(id(n) for n in chain)
        self.scope = chain[-1]
        return self.scope

    def add(self, edit: Edit) -> None:
        self.out.edits.append(edit)

    def keep_written_definitions(self, target: Any, code: str) -> None:
        """Definitions a patch writes next to a top-level statement are pruning roots, as add_definition's are."""
        if any(s is target for s in self.module.body):
            self.out.added_names.update(defined_names(parse_statements(code, self.patch)))


class Op:
    """A patch kind's operation. Subclasses say which spec keys they take and how they resolve and apply."""

    name: ClassVar[str]
    keys: ClassVar[tuple[tuple[str, ...], ...]] = ((),)  # the accepted sets of anchor keys (before/after/anchor)
    keys_help: ClassVar[str] = "no anchor key: the scope names the target"
    takes_through: ClassVar[bool] = False  # `through` (end of a replaced run of statements)
    builtins: ClassVar[tuple[str, ...]] = ("scope",)  # the builtin template variables it provides
    replaces: ClassVar[bool] = False  # its target is replaced wholesale

    def check_keys(self, given: tuple[str, ...]) -> str | None:
        """None when the anchor keys a spec patch gives fit this op, else what the op takes."""
        return None if given in self.keys else self.keys_help

    def resolve(self, ctx: ResolveContext) -> None:
        raise NotImplementedError

    # The rewrite calls these on the edits whose target is the node being left; `rewrite` is the transformer.
    def apply_expression(self, edit: Edit, node: Any, rewrite: Any) -> Any:
        return node

    def apply_in_place(self, edit: Edit, node: Any, rewrite: Any) -> Any:
        """Statement edits that change the statement itself (before markers are attached)."""
        return node

    def apply_around(self, edit: Edit, splice: Splice, rewrite: Any) -> None:
        """Statement edits that add or replace statements around it (after markers are attached)."""

    def apply_module(self, edit: Edit, body: list, rewrite: Any) -> None:
        """Edits of the module body (appended definitions)."""
