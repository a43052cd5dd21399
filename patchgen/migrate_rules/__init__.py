"""The migration rules of `patchgen upgrade --migrate` (stated for users in docs/upgrading-transformers.md), each a
narrow statement of when a failing patch keeps its meaning on a new release:
1. a moved anchor: the same statement respelled, or the same assignment with other call arguments;
2. a renamed or moved scope: the unchanged anchor matches once, in one other definition of the same kind;
3. the same variable, bound by other code: an insert after an assignment, or a template re-implementing the whole
   `target =` statement, follows the (last, unbranched) statement binding the same targets;
4. a changed condition: an insert before/after a branch follows the only `if` testing one conjunct more or fewer;
5. code moved into the definition the old scope delegates to (`self.model = ThinkerModel(config)`, then
   `self.model(...)`): the unchanged anchor, or rule 1, 3 or 4, in exactly one delegate.
Each rule proposes `{spec key: new value}` with its reason, or says in one line why the patch is left to the human.
One module per rule; the package is a front end (patchgen/provenance.py FRONT_ENDS): it decides no byte of a
generated file, so its modules are not hashed into the headers."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import ANCHOR_MOVED, SCOPE_MISSING, LocateError
from patchgen.cst.plan import PlanError
from patchgen.generate import UnitSource
from patchgen.migrate_rules.anchor import anchor_rule
from patchgen.migrate_rules.common import holders
from patchgen.migrate_rules.condition import condition_rule
from patchgen.migrate_rules.delegate import delegate_rule
from patchgen.migrate_rules.rebound import rebound_rule
from patchgen.migrate_rules.scope import scope_rule

__all__ = ["propose"]


def propose(error: PlanError, new: UnitSource, old: UnitSource | None) -> tuple[dict[str, str], str] | str:
    """The edits (spec key -> new value, in the spec's naming) that would make a failing patch apply, or why not."""
    patch = error.patch
    old_module = old.module if old is not None else None
    try:
        if error.kind == ANCHOR_MOVED:
            found = anchor_rule(patch, new.module)
            if isinstance(found, str):
                tried = [
                    rebound_rule(patch, new.module, old_module),
                    condition_rule(patch, new.module),
                    delegate_rule(patch, new.module, old_module),
                ]
                done = [t for t in tried if isinstance(t, tuple)]
                if done:
                    return done[0]
                found = "; ".join([found, *(t for t in tried if isinstance(t, str))])
            if isinstance(found, str) and patch.anchor_text and patch.scope != "<module>":
                elsewhere = sorted(set(holders(new.module, patch)) - {patch.scope})
                if elsewhere:  # a hint only: the scope still exists, so the code was refactored, not renamed
                    found += f"; the unchanged anchor is now in {', '.join(elsewhere)} (the old scope still exists)"
            return found
        if error.kind == SCOPE_MISSING:
            return scope_rule(patch, new.module, old_module)
    except (LocateError, SyntaxError, cst.ParserSyntaxError) as exc:
        return f"cannot analyse: {getattr(exc, 'message', exc)}"
    return f"no migration rule for `{error.kind}`"
