"""The operations a template can declare (`op = "..."` in its front matter), one module each.

Each module owns its spec keys, its resolution to upstream nodes and how its edits are applied; `keep` / `exclude`
(pruning) live in `exclude.py`. Importing this package does not import libcst (see `patchgen.ops.base`).
"""

from __future__ import annotations

from patchgen.ops import add_definition, add_method, add_parameter, insert, rename, replace, replace_definition, wrap
from patchgen.ops.base import Op

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        insert.OP,
        replace.OP,
        wrap.OP,
        add_method.OP,
        replace_definition.METHOD,
        add_definition.OP,
        replace_definition.DEFINITION,
        rename.OP,
        add_parameter.OP,
    )
}
