"""`rename`: a top-level definition and every reference to it in the module get the name `vars.to`.

References are Name nodes; attribute names, keyword arguments and imports are not references (an import binds an
upstream name). `__all__` lists definitions as strings: a renamed definition is exported under its new name.
"""

from __future__ import annotations

from patchgen.ops.base import Edit, Op, PlanError, ResolveContext, cst, marker_text, patch_label


class Rename(Op):
    name = "rename"

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        if "." in patch.scope or "to" not in patch.vars:
            raise PlanError(patch, "op rename takes a top-level definition as scope and the new name as vars.to")
        scope = ctx.scope_node()
        ctx.out.renames[patch.scope] = patch.vars["to"]
        ctx.add(Edit(patch, self, scope, patch.vars["to"]))

    def apply_in_place(self, edit: Edit, node, rewrite):
        rewrite.count(edit)  # the definition's own name is a Name node, renamed with the references
        return node


OP = Rename()


class Renamer:
    """The module-wide part of renaming, driven by the rewrite's visit/leave of every node."""

    def __init__(self, edits: list[Edit]) -> None:
        self.by_name = {e.target.name.value: e for e in edits}
        self._not_references: set[int] = set()

    def visit(self, node) -> bool:
        """False for subtrees that hold no reference (imports); remembers names that are not references."""
        if isinstance(node, cst.Attribute):
            self._not_references.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            self._not_references.add(id(node.keyword))
        elif isinstance(node, cst.ImportAlias | cst.ImportFrom):
            return False
        return True

    def leave(self, original, updated, markers: list[str]):
        if isinstance(original, cst.Name):
            edit = self.by_name.get(original.value)
            if edit is not None and id(original) not in self._not_references:
                markers.append(marker_text(patch_label(edit.patch), 1, edit.patch.why))
                return updated.with_changes(value=edit.code)
        elif isinstance(original, cst.Assign):
            return self._rename_exports(updated, markers)
        return updated

    def _rename_exports(self, node, markers: list[str]):
        if not (
            len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
            and node.targets[0].target.value == "__all__"
            and isinstance(node.value, cst.List | cst.Tuple)
        ):
            return node
        elements = []
        for element in node.value.elements:
            value = element.value
            if isinstance(value, cst.SimpleString) and value.evaluated_value in self.by_name:
                edit = self.by_name[value.evaluated_value]
                element = element.with_changes(
                    value=value.with_changes(value=f"{value.prefix}{value.quote}{edit.code}{value.quote}")
                )
                markers.append(marker_text(patch_label(edit.patch), 1, edit.patch.why))
            elements.append(element)
        return node.with_changes(value=node.value.with_changes(elements=elements))
