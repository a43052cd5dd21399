"""`add_method`: the rendered class-body statements (methods, attributes) are appended to the scope class.

A method name the class already defines is a conflict: replace it with a `replace_method` template instead.
"""

from __future__ import annotations

from patchgen.ops.base import (
    CONFLICT,
    SCOPE_MISMATCH,
    Edit,
    Op,
    PlanError,
    ResolveContext,
    cst,
    defined_names,
    marked_block,
    parse_statements,
)


class AddMethod(Op):
    name = "add_method"

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        scope = ctx.scope_node()
        if not isinstance(scope, cst.ClassDef):
            raise PlanError(
                patch, f"op add_method needs a class scope, {patch.scope!r} is not a class", kind=SCOPE_MISMATCH
            )
        code = ctx.render()
        existing = {s.name.value for s in scope.body.body if isinstance(s, cst.FunctionDef)}
        clash = sorted(existing & set(defined_names(parse_statements(code, patch))))
        if clash:
            raise PlanError(
                patch, f"{patch.scope} already defines {clash}; use a replace_method template instead", kind=CONFLICT
            )
        ctx.add(Edit(patch, self, scope, code))

    def apply_in_place(self, edit: Edit, node, rewrite):
        rewrite.count(edit)
        members = marked_block(edit.patch, edit.code, leading=[cst.EmptyLine(indent=False)])
        return node.with_changes(body=node.body.with_changes(body=[*node.body.body, *members]))


OP = AddMethod()
