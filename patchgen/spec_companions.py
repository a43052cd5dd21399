"""Multi-module specs: the `[[companion]]` tables, and the `<module>:<scope>` qualifiers that pick among them.

A spec may patch definitions its module imports from other modules of the same distribution: each `[[companion]]`
names such a module and the definitions to redefine (`keep`); it is generated beside the main output
(`patchgen.units`). A patch's scope names a definition of any of them, qualified as `<module>:<scope>` (the module's
last dotted component) when the name alone is not unique. Apart from loading (`patchgen.spec`) because the project
checks (`patchgen.spec_set`) place companion outputs from raw tables, before any spec is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from patchgen.errors import PatchgenError
from patchgen.spec_schema import COMPANION_KEYS, MAX_COMPANIONS, check_keys, names
from patchgen.varkinds import is_dotted, is_identifier, type_name


class Qualified(Protocol):
    """What ``check_qualifiers`` reads of a patch (``patchgen.spec.Patch``, which imports this module)."""

    module: str  # "" when the scope is not qualified

    @property
    def label(self) -> str: ...

    @property
    def where(self) -> str: ...


@dataclass(frozen=True)
class Companion:
    """A module of the spec's upstream distribution whose `keep` definitions the spec redefines: generated as
    `<output folder>/<last module component>.py`, and every generated file of the spec imports them from there."""

    module: str
    keep: tuple[str, ...]
    output: str

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]


def companion_output(output: str, module: str) -> str:
    """Where the companion `module` of a spec with this `output` is generated: the main output's folder."""
    return str(PurePosixPath(output).parent / f"{module.rsplit('.', 1)[-1]}.py")


def load_companions(data: dict, path: Path) -> tuple[Companion, ...]:
    """The `[[companion]]` tables: modules of the spec's own distribution, each generated beside the output under
    its last module component, which must differ from the main module's and every other companion's."""
    tables = data.get("companion", [])
    if len(tables) > MAX_COMPANIONS:
        raise PatchgenError(f"{path}: {len(tables)} [[companion]] tables; at most {MAX_COMPANIONS} per spec")
    out: list[Companion] = []
    main = data["module"]
    for number, table in enumerate(tables, start=1):
        where = f"companion {number}"
        if not isinstance(table, dict):
            raise PatchgenError(f"{path}: {where}: must be a table ([[companion]]), found {type_name(table)}")
        check_keys(table, COMPANION_KEYS, tuple(COMPANION_KEYS), path, where)
        module = table["module"]
        if not is_dotted(module) or module.split(".")[0] != main.split(".")[0] or module == main:
            raise PatchgenError(
                f"{path}: {where}: module {module!r} must be another module of {main.split('.')[0]!r}, the "
                f"distribution of the spec's module {main!r} (e.g. {main.split('.')[0]}.models.attention_processor)"
            )
        keep = names(table["keep"], path, f"companion {number} keep")
        if not keep:
            raise PatchgenError(f"{path}: {where}: 'keep' must name the definitions of {module} the spec redefines")
        companion = Companion(module, keep, companion_output(data["output"], module))
        taken = [main.rsplit(".", 1)[-1], PurePosixPath(data["output"]).stem, *(c.name for c in out)]
        if companion.name in taken:
            raise PatchgenError(
                f"{path}: {where}: module {module!r} would be generated as {companion.output}, which another module "
                f"of this spec already uses (its last component {companion.name!r} must be unique)"
            )
        out.append(companion)
    return tuple(out)


def _is_scope(scope: str) -> bool:
    return scope == "<module>" or is_dotted(scope)


def split_scope(scope: str) -> tuple[str, str]:
    """`attention_processor:Cls.fn` -> ("attention_processor", "Cls.fn"); an unqualified scope -> ("", scope)."""
    module, sep, rest = scope.partition(":")
    return (module, rest) if sep else ("", scope)


def parse_scope(text: str, path: Path, where: str) -> tuple[str, str]:
    """A patch's `scope` value -> (its qualifying module or "", the scope), refusing what names no definition."""
    module, scope = split_scope(text)
    if not _is_scope(scope) or module and not is_identifier(module):
        raise PatchgenError(
            f"{path}: {where}: 'scope' must be '<module>', a top-level name or a dotted path such as Class.method, "
            f"optionally qualified by the module that defines it (attention_processor:Class.method); "
            f"found {text!r}"
        )
    return module, scope


def check_qualifiers(patches: Iterable[Qualified], module: str, companions: tuple[Companion, ...], path: Path) -> None:
    """Every qualified scope names the spec's module or one of its companions (by the last dotted component)."""
    known = [module.rsplit(".", 1)[-1], *(c.name for c in companions)]
    for patch in patches:
        if patch.module and patch.module not in known:
            raise PatchgenError(
                f"{path}: {patch.label}: scope {patch.where!r}: {patch.module!r} is neither the spec's module nor a "
                f"companion; qualify a scope by the last component of one of {known}"
            )
