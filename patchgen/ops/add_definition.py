"""`add_definition`: rendered top-level code, appended at the end of the module or next to an anchored top-level
statement. Every definition it writes is a pruning root (never pruned away)."""

from __future__ import annotations

from patchgen.ops.base import (
    Edit,
    Op,
    PlanError,
    ResolveContext,
    Splice,
    cst,
    defined_names,
    marked_block,
    parse_statements,
    put_beside,
    statement_anchors,
)


class AddDefinition(Op):
    name = "add_definition"
    keys = ((), ("before",), ("after",))
    keys_help = "at most one of 'before' or 'after'"

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        if patch.scope != "<module>":
            raise PlanError(patch, f"op add_definition takes scope '<module>', found {patch.scope!r}")
        code = ctx.render()
        ctx.out.added_names.update(defined_names(parse_statements(code, patch)))
        if patch.anchor_text is None:
            ctx.add(Edit(patch, self, ctx.module, code, where="end"))
        else:
            target = statement_anchors.find_statement(ctx.module, patch.anchor_text, patch.scope, ctx.index)
            ctx.add(Edit(patch, self, target, code, where="before" if patch.before else "after"))

    def apply_around(self, edit: Edit, splice: Splice, rewrite) -> None:
        put_beside(edit, splice, rewrite)

    def apply_module(self, edit: Edit, body: list, rewrite) -> None:
        rewrite.count(edit)
        body.extend(marked_block(edit.patch, edit.code, leading=[cst.EmptyLine(), cst.EmptyLine()]))


OP = AddDefinition()
