"""`keep` / `exclude`: which top-level definitions the output has. Pruning keeps what the `keep` roots (and the code
patches add) reach, never traversing an excluded definition; any reference left to a pruned or excluded name is a
generation-time error (`patchgen.cst.prune.check_dangling`)."""

from __future__ import annotations

import ast
import textwrap
from typing import TYPE_CHECKING, Any

from patchgen.errors import PatchgenError
from patchgen.ops.base import LazyModule, cst

prune: Any = LazyModule("patchgen.cst.prune")  # imports libcst

if TYPE_CHECKING:
    from patchgen.cst.plan import Plan
    from patchgen.spec import Spec
    from patchgen.units import Unit
    from patchgen.upstream import UpstreamFile


def check_roots(spec: Spec, unit: Unit, upstream: UpstreamFile, module) -> None:
    """Every `keep` and `exclude` name of a unit (the spec's module or a companion) is a top-level definition of
    its upstream module."""
    top_level = {s.name.value for s in module.body if isinstance(s, cst.ClassDef | cst.FunctionDef)}
    roots = f"companion {unit.module!r} keep" if unit.companion else "keep"
    for key, names in ((roots, unit.keep), ("exclude", unit.exclude)):
        unknown = [n for n in names if n not in top_level]
        if unknown:
            raise PatchgenError(
                f"{spec.path}: {key} names {unknown}, which {upstream.relpath} ({upstream.pin}) "
                f"does not define at top level"
            )


def kept_definitions(unit: Unit, upstream: UpstreamFile, plan: Plan) -> set[str]:
    """Definitions reachable from the roots, computed on upstream's ast plus the references patches add."""
    added_refs = set().union(*(prune.references(ast.parse(textwrap.dedent(code))) for code in plan.rendered))
    tree = prune.parsed(upstream.text, f"{upstream.relpath} ({upstream.pin})")
    reached = prune.reachable_definitions(tree, [*unit.keep, *sorted(added_refs)], unit.exclude)
    return {plan.renames.get(n, n) for n in reached - set(unit.exclude)} | plan.added_names
