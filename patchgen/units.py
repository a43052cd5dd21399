"""A spec's generated files: its module and its companions, and what ties them together.

diffusers keeps processors and blocks in shared modules (`attention_processor.py`, `attention.py`) that a model
module imports. A spec patches such a definition by naming its module as a `[[companion]]` with the definitions to
redefine (`keep`). Each module the spec generates is a `Unit`; a patch belongs to the unit whose upstream module
defines its scope (`assign`). In every generated file of the spec, an import of a name a companion redefines is
re-pointed to the companion (`Redefined`); names the generated files still import from upstream must not reach a
redefined definition through upstream code (`check_links`): that code would run upstream's definition, not the
patched one, and nothing would say so.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from patchgen.cst.prune import bound_names, parsed
from patchgen.errors import PatchgenError
from patchgen.model import module_of

if TYPE_CHECKING:
    from patchgen.spec import Patch, Spec
    from patchgen.upstream import UpstreamSource

MAX_REEXPORT_HOPS = 4  # `from .a import X` chains followed to X's definition (diffusers re-exports one level)


@dataclass(frozen=True)
class Unit:
    """One generated file of a spec: the spec's module, or one of its companions."""

    name: str  # the upstream module's last component: how a qualified scope names it (`attention_processor:...`)
    module: str
    output: str
    keep: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    companion: bool = False

    @property
    def generated_module(self) -> str:
        return module_of(self.output)


def units(spec: Spec) -> tuple[Unit, ...]:
    """The spec's module first, then its companions in spec order."""
    main = Unit(spec.module.rsplit(".", 1)[-1], spec.module, spec.output, spec.keep, spec.exclude)
    return (main, *(Unit(c.name, c.module, c.output, c.keep, (), True) for c in spec.companions))


def assign(spec: Spec, all_units: tuple[Unit, ...], defined: Mapping[str, set[str]]) -> dict[str, tuple[Patch, ...]]:
    """The patches of each unit (by unit name): a qualified scope names its unit; `<module>` is the spec's module;
    any other scope belongs to the unit whose upstream module defines its first name at top level (`defined`), or
    to the spec's module when none does (resolving it there then reports the missing scope)."""
    main = all_units[0].name
    out: dict[str, list[Patch]] = {unit.name: [] for unit in all_units}
    for patch in spec.patches:
        if patch.module:
            out[patch.module].append(patch)
            continue
        top = patch.scope.split(".")[0]
        having = [u.name for u in all_units if patch.scope != "<module>" and top in defined[u.name]]
        if len(having) > 1:
            raise PatchgenError(
                f"{spec.path}: {patch.label}: scope {patch.scope!r}: {top} is defined in {' and '.join(having)}; "
                f'say which, e.g. scope = "{having[-1]}:{patch.scope}"'
            )
        out[having[0] if having else main].append(patch)
    return {name: tuple(patches) for name, patches in out.items()}


@dataclass(frozen=True)
class Redefined:
    """What the companions of a spec redefine: upstream module -> (generated module, names)."""

    by_module: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)

    def target(self, upstream_module: str, name: str) -> str | None:
        """The generated module that redefines `upstream_module.name`, or None."""
        entry = self.by_module.get(upstream_module)
        return entry[0] if entry is not None and name in entry[1] else None

    def owner(self, upstream_module: str, name: str) -> str | None:
        """The companion (its last module component) that redefines it, or None."""
        return upstream_module.rsplit(".", 1)[-1] if self.target(upstream_module, name) else None

    @property
    def names(self) -> frozenset[str]:
        return frozenset().union(*(names for _, names in self.by_module.values()))


def redefined(companions: Iterable[tuple[Unit, Iterable[str]]]) -> Redefined:
    """The companions' keep roots and the definitions their patches add."""
    return Redefined(
        {unit.module: (unit.generated_module, frozenset([*unit.keep, *added])) for unit, added in companions}
    )


def companion_imports(unit: Unit, patches: Iterable[Patch], tree: ast.Module, companions: Redefined) -> list[str]:
    """Imports of the generated companion classes a unit's patches name as module-level classes (``module_level``
    vars, e.g. ``dit/shard_tokens``' SP-aware processors) but the unit's upstream module never imports: PixArt's
    module uses ``AttnProcessor2_0`` only through ``Attention``'s default, and the generated module must check
    instances of the spec's (SP-aware) copy, not upstream's. Names the module binds itself are left alone (an
    import of a redefined name is re-pointed anyway)."""
    top = set().union(set(), *(bound_names(stmt) for stmt in tree.body))
    wanted: dict[str, list[str]] = {}
    for patch in patches:
        for var in patch.template.vars:
            if not var.module_level:
                continue
            value = patch.vars.get(var.name, None if var.required else var.default)
            for name in value if isinstance(value, list) else [value]:
                if not isinstance(name, str) or name in top:
                    continue
                for upstream, (generated, names) in sorted(companions.by_module.items()):
                    if name in names and upstream != unit.module and name not in wanted.setdefault(generated, []):
                        wanted[generated].append(name)
                        break
    return [f"from {module} import {', '.join(names)}" for module, names in wanted.items() if names]


def absolute_module(module: str, level: int, name: str | None) -> str:
    """The module a `from <level dots><name> import ...` in `module` (a .py module, not a package) names."""
    if not level:
        return name or ""
    base = module.rsplit(".", level)[0]
    return f"{base}.{name}" if name else base


def imported_names(tree: ast.Module, module: str) -> dict[str, tuple[str, str]]:
    """Top-level `from x import a as b` bindings of a module: b -> (absolute x, a)."""
    out: dict[str, tuple[str, str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            source = absolute_module(module, stmt.level, stmt.module)
            for alias in stmt.names:
                if alias.name != "*":
                    out[alias.asname or alias.name] = (source, alias.name)
    return out


def definitions(tree: ast.Module) -> dict[str, ast.AST]:
    return {s.name: s for s in tree.body if isinstance(s, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}


def uses(node: ast.AST) -> set[str]:
    """Names a definition reads in a way that runs what they name: every loaded name except those in annotations
    and in the class argument of `isinstance` / `issubclass` (an identity test runs nothing)."""
    names: set[str] = set()
    stack: list[ast.AST] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.Name):
            if isinstance(current.ctx, ast.Load):
                names.add(current.id)
            continue
        if (
            isinstance(current, ast.Call)
            and isinstance(current.func, ast.Name)
            and current.func.id in ("isinstance", "issubclass")
            and len(current.args) == 2
        ):
            stack.append(current.args[0])
            continue
        for name, value in ast.iter_fields(current):
            if name in ("annotation", "returns"):
                continue
            if isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)
    return names


def check_links(spec: Spec, files: list[tuple[str, str]], companions: Redefined, source: UpstreamSource) -> None:
    """Refuse a name a generated file imports from upstream whose upstream definition uses (one level) a definition
    a companion redefines: upstream's code would build or run upstream's version. `files` are (output, text)."""
    wanted = companions.names
    if not wanted:
        return
    package = spec.package
    for output, text in files:
        for local, (module, name) in sorted(imported_names(parsed(text, output), module_of(output)).items()):
            if module.split(".")[0] != package or companions.target(module, name):
                continue
            found = _definition(source, module, name, wanted)
            if found is None:
                continue
            where, node, tree = found
            scope, defined = imported_names(tree, where), definitions(tree)
            for used in sorted(uses(node)):
                if used not in defined and used not in scope:
                    continue  # a local, a parameter or a builtin
                owner_module, owner_name = scope.get(used, (where, used))
                owner = companions.owner(owner_module, owner_name)
                if owner is None:
                    continue
                fix = (
                    f"add {name!r} to the keep of companion {where.rsplit('.', 1)[-1]!r}"
                    if where in companions.by_module
                    else f'declare [[companion]] module = "{where}", keep = ["{name}"]'
                )
                raise PatchgenError(
                    f"{spec.path}: {output} imports {local} from {module} (upstream), whose definition in {where} "
                    f"uses {owner_name}, which companion {owner!r} redefines: upstream's {name} would run upstream's "
                    f"{owner_name}, not the spec's. Redefine it too: {fix}"
                )


def _definition(
    source: UpstreamSource, module: str, name: str, wanted: frozenset[str]
) -> tuple[str, ast.AST, ast.Module] | None:
    """(module, node, module tree) of the upstream definition of `module.name`, following re-exports; None when it
    is not a class or function, cannot be read, or its module mentions no redefined name at all (nothing to find)."""
    for _ in range(MAX_REEXPORT_HOPS):
        try:
            upstream = source.read(module)
        except PatchgenError:
            return None  # a package (`__init__`) or a module that is not a file: not followed
        text = upstream.text
        if not any(w in text for w in wanted) and (f"class {name}" in text or f"def {name}" in text):
            return None  # defined here, and nothing here names what the companions redefine
        tree = parsed(text, f"{upstream.relpath} ({upstream.pin})")  # the key pruning and the name checks use
        node = definitions(tree).get(name)
        if node is not None:
            return module, node, tree
        reexport = imported_names(tree, module).get(name)
        if reexport is None:
            return None
        module, name = reexport
    return None
