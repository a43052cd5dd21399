"""`insert`: the rendered statements go right before or after an anchored statement of the scope."""

from __future__ import annotations

from patchgen.ops.base import Edit, Op, ResolveContext, Splice, parse_statements, put_beside, statement_anchors


class Insert(Op):
    name = "insert"
    keys = (("before",), ("after",))
    keys_help = "exactly one of 'before' or 'after'"

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        target = statement_anchors.find_statement(ctx.scope_node(), patch.anchor_text, patch.scope, ctx.index)
        code = ctx.render()
        parse_statements(code, patch)  # invalid code is this patch's error now, not the rewrite's later
        ctx.add(Edit(patch, self, target, code, where="before" if patch.before else "after"))
        ctx.keep_written_definitions(target, code)

    def apply_around(self, edit: Edit, splice: Splice, rewrite) -> None:
        put_beside(edit, splice, rewrite)


OP = Insert()
