"""`replace`: an anchored statement, or a run of sibling statements `anchor` .. `through`, becomes the rendered code.

The replacement keeps the first statement's leading comments; the rest of the run is removed.
"""

from __future__ import annotations

from patchgen.ops.base import Edit, Op, ResolveContext, Splice, parse_statements, put_over, statement_anchors


class Replace(Op):
    name = "replace"
    keys = (("anchor",),)
    keys_help = "'anchor' (the statement to replace)"
    takes_through = True
    replaces = True

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        scope = ctx.scope_node()
        if patch.through is None:
            run = [statement_anchors.find_statement(scope, patch.anchor, patch.scope, ctx.index)]
        else:
            run = statement_anchors.find_statement_range(scope, patch.anchor, patch.through, patch.scope, ctx.index)
        code = ctx.render()
        parse_statements(code, patch)
        ctx.add(Edit(patch, self, run[0], code, tuple(run[1:])))
        ctx.keep_written_definitions(run[0], code)

    def apply_around(self, edit: Edit, splice: Splice, rewrite) -> None:
        put_over(edit, splice, rewrite)


OP = Replace()
