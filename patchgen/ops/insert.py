"""`insert`: the rendered statements go right before or after an anchored statement of the scope."""

from __future__ import annotations

from patchgen.cst.attention_calls import attention_call_problem
from patchgen.ops.base import (
    RENDER_ERROR,
    Edit,
    Op,
    PlanError,
    ResolveContext,
    Splice,
    locate,
    parse_statements,
    put_beside,
    statement_anchors,
)


class Insert(Op):
    name = "insert"
    keys = (("before",), ("after",))
    keys_help = "exactly one of 'before' or 'after'"

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        target = statement_anchors.find_statement(ctx.scope_node(), patch.anchor_text, patch.scope, ctx.index)
        code = ctx.render()
        parse_statements(code, patch)  # invalid code is this patch's error now, not the rewrite's later
        check = getattr(patch.template, "attention_call", None)
        if check is not None:  # a stated attention layout the anchored call contradicts (patchgen.cst.attention_calls)
            values = {v.name: patch.vars.get(v.name, None if v.required else v.default) for v in patch.template.vars}
            problem = attention_call_problem(locate.code_of(target), check, values)
            if problem is not None:
                raise PlanError(patch, problem, kind=RENDER_ERROR)
        ctx.add(Edit(patch, self, target, code, where="before" if patch.before else "after"))
        ctx.keep_written_definitions(target, code)

    def apply_around(self, edit: Edit, splice: Splice, rewrite) -> None:
        put_beside(edit, splice, rewrite)


OP = Insert()
