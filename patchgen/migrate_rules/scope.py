"""Rule 2, a renamed or moved scope: the unchanged anchor matches once, in one other definition of the same
kind."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import LocateError
from patchgen.cst.scopes import find_scope
from patchgen.migrate_rules.common import holders
from patchgen.spec import Patch


def scope_rule(patch: Patch, module: cst.Module, old_module: cst.Module | None) -> tuple[dict[str, str], str] | str:
    """Rule 2: the new scope, or why the scope is left to the human."""
    if patch.anchor_text is None or patch.scope == "<module>":
        return "no anchor to follow to another scope"
    others = {k: v for k, v in holders(module, patch).items() if k != patch.scope}
    if len(others) != 1:
        where = ", ".join(sorted(others)) or "no definition"
        return f"scope {patch.scope} is gone; the unchanged anchor is in {where}, not in exactly one other definition"
    ((scope, count),) = others.items()
    if count != 1:
        return f"scope: the unchanged anchor matches {count} times in {scope}"
    kind = type(find_scope(module, scope))
    if old_module is not None:
        try:
            if type(find_scope(old_module, patch.scope)) is not kind:
                return f"scope: {scope} is not the same kind of definition as {patch.scope}"
        except LocateError:
            pass
    qualified = f"{patch.module}:{scope}" if patch.module else scope
    return {"scope": qualified}, f"rule 2 (moved scope): the unchanged anchor matches once, only in `{scope}`"
