"""What draft recognised in an upstream module: each structure with the patch that serves it (`Found`) and the
whole reading (`Recognised`), shared by the LM and DiT recognisers and the spec writer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from patchgen.draft.names import Target
from patchgen.upstream import UpstreamFile

__all__ = ["Found", "Recognised"]


@dataclass
class Found:
    """One recognised structure: the patch that serves it and where it was found."""

    template: str
    scope: str
    why: str
    note: str  # what was recognised, and where (file:line)
    anchor: str | None = None
    through: str | None = None
    vars: dict[str, Any] = field(default_factory=dict)
    place: str = "anchor"  # the spec key the anchor goes under: anchor, before or after


@dataclass
class Recognised:
    """What the module holds, as draft read it; `facts` feed the tiny-config rule (patchgen/draft/tiny.py)."""

    target: Target
    upstream: UpstreamFile
    patches: list[Found] = field(default_factory=list)
    unsupported: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    handles: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    companions: list[tuple[str, list[str]]] = field(default_factory=list)  # (module, classes it redefines)
