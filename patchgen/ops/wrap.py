"""`wrap`: an anchored expression becomes the rendered expression, which contains it as `{{ expr }}`.

Rendered again on the rewritten tree, so wraps of the same expression nest (each sees the effect of the earlier
ones). The marker goes above the innermost statement holding the expression.
"""

from __future__ import annotations

from patchgen.ops.base import RENDER_ERROR, Edit, Op, PlanError, ResolveContext, cst, expression_anchors, locate


class Wrap(Op):
    name = "wrap"
    keys = (("anchor",),)
    keys_help = "'anchor' (the expression to wrap)"
    builtins = ("scope", "expr")

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        target = expression_anchors.find_expression(ctx.scope_node(), patch.anchor, patch.scope, ctx.index)
        code = ctx.render({"expr": locate.code_of(target)})  # validated now; rendered again on the final tree
        try:
            cst.parse_expression(code.strip())
        except cst.ParserSyntaxError as exc:
            raise PlanError(
                patch, f"rendered wrap is not a Python expression: {code.strip()!r}", kind=RENDER_ERROR
            ) from exc
        ctx.add(Edit(patch, self, target, ""))

    def apply_expression(self, edit: Edit, node, rewrite):
        patch = edit.patch
        code = patch.template.render(patch.vars, {"scope": patch.scope, "expr": locate.code_of(node)})
        rewrite.count(edit)
        rewrite.mark(edit)
        return cst.parse_expression(code.strip())


OP = Wrap()
