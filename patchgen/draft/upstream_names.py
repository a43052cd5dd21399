"""Where a name used in an upstream module is defined: the module itself, or the module a `from .x import name`
brings it from (followed through re-exports). Several pinned modules of one distribution, parsed once each, for the
recognisers that follow a class out of the model's module (a DiT's blocks and attention processors in diffusers'
shared modules)."""

from __future__ import annotations

import libcst as cst

from patchgen.draft.structure import Module, dotted
from patchgen.errors import PatchgenError
from patchgen.upstream import UpstreamSource

HOPS = 4  # re-exports followed at most (diffusers' attention.py re-exports attention_processor's Attention)


class Modules:
    """The pinned upstream modules read so far, by dotted name."""

    def __init__(self, source: UpstreamSource, main: str, mod: Module) -> None:
        self.source = source
        self.parsed: dict[str, Module] = {main: mod}

    def get(self, name: str) -> Module:
        if name not in self.parsed:
            self.parsed[name] = Module(self.source.read(name))
        return self.parsed[name]

    def name_of(self, mod: Module) -> str:
        return next(name for name, m in self.parsed.items() if m is mod)

    def origin(self, module: str, name: str, hops: int = HOPS) -> tuple[str, str] | None:
        """(module, name) of the top-level class `name` as `module` sees it; None when it neither defines nor
        imports it from a module of its package."""
        mod = self.get(module)
        if name in mod.classes:
            return module, name
        imported = imports(mod.tree.body, module).get(name)
        if imported is None or hops == 0:
            return None
        try:
            return self.origin(imported[0], imported[1], hops - 1)
        except PatchgenError:  # a package (`...utils`), not a module file: no class draft follows
            return None


def imports(statements: list[cst.CSTNode] | tuple, module: str) -> dict[str, tuple[str, str]]:
    """local name -> (module, name) of the relative `from ... import` statements among `statements`."""
    out: dict[str, tuple[str, str]] = {}
    for stmt in statements:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if not isinstance(small, cst.ImportFrom) or not small.relative or isinstance(small.names, cst.ImportStar):
                continue
            base = module.split(".")[: -len(small.relative)]
            source = ".".join([*base, dotted(small.module)] if small.module is not None else base)
            for alias in small.names:
                local = alias.asname.name.value if alias.asname is not None else dotted(alias.name)
                out[local] = (source, dotted(alias.name))
    return out
