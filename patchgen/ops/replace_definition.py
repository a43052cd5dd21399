"""`replace_method` / `replace_definition`: a method (`Class.method`) or a top-level class or function is replaced
by the rendered code as a whole."""

from __future__ import annotations

from patchgen.ops.base import (
    SCOPE_MISMATCH,
    SPEC_ERROR,
    Edit,
    Op,
    PlanError,
    ResolveContext,
    Splice,
    cst,
    parse_statements,
    put_over,
)


class ReplaceDefinition(Op):
    replaces = True

    def __init__(self, name: str, method: bool) -> None:
        self.name = name
        self.method = method

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        scope = ctx.scope_node()
        dotted = "." in patch.scope
        if self.method != dotted or not isinstance(scope, cst.FunctionDef | cst.ClassDef):
            shape = "'Class.method'" if self.method else "a top-level class or function name"
            kind = SPEC_ERROR if self.method != dotted else SCOPE_MISMATCH
            raise PlanError(patch, f"op {self.name} takes scope {shape}, found {patch.scope!r}", kind=kind)
        code = ctx.render()
        parse_statements(code, patch)
        ctx.add(Edit(patch, self, scope, code))

    def apply_around(self, edit: Edit, splice: Splice, rewrite) -> None:
        put_over(edit, splice, rewrite)


METHOD = ReplaceDefinition("replace_method", method=True)
DEFINITION = ReplaceDefinition("replace_definition", method=False)
