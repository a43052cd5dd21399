"""A model the project does not ship, drafted with no hand edit and generated into a scratch package: what the
draft tests share. ``generate_drafted`` writes the generated module and its record under ``<root>/generated``;
``drafted_installed`` makes them importable as ``generated.<name>`` and known to the registry, and undoes both on
exit, so it serves the pytest process and a spawned rank alike (the rank pools are shared across tests)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DraftedModel", "drafted_installed", "generate_drafted"]


@dataclass(frozen=True)
class DraftedModel:
    """One drafted model in a scratch package (plain data: a spawned rank gets it pickled)."""

    argument: str  # what draft was given: a model type or a diffusers class
    model_type: str  # its registry key
    package: str  # generated.<name>
    module: str  # generated.<name>.<stem>: the generated module
    record: Path  # its .model.json
    draft_s: float  # the draft's wall time (no interpreter start, no generation)


def generate_drafted(argument: str, root: Path) -> DraftedModel:
    """Draft ``argument`` (no hand edit), generate it, write its files and record under ``root/generated``."""
    from patchgen.config import load_config
    from patchgen.draft.loading import load_drafted
    from patchgen.draft.pipeline import draft_spec
    from patchgen.generate import generate
    from patchgen.ownership import model_record
    from patchgen.upstream import PinnedSource
    from tests.engine.helpers import REPO

    config = load_config(REPO)
    source = PinnedSource(config.pins)
    started = time.perf_counter()
    drafted = draft_spec(argument, source, config.pins, project=config)
    draft_s = time.perf_counter() - started
    spec = load_drafted(config, drafted.target.name, drafted.text)
    files = generate(spec, source, config).files
    for generated in files:
        path = root / generated.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(generated.text)
    main = root / spec.output
    record = main.with_suffix(".model.json")
    record.write_text(model_record(spec))
    package = f"generated.{main.parent.name}"
    return DraftedModel(argument, spec.model.model_type, package, f"{package}.{main.stem}", record, draft_s)


def _drop_modules(packages: Sequence[str]) -> None:
    for name in [n for n in sys.modules if any(n == p or n.startswith(p + ".") for p in packages)]:
        del sys.modules[name]


@contextlib.contextmanager
def drafted_installed(root: Path, models: Sequence[DraftedModel]) -> Iterator[None]:
    """``root/generated`` on the generated package's path and each model's record in the registry, fresh modules;
    the path, the registry and the module cache as they were afterwards."""
    import generated
    from runtime.models import registry

    path = list(generated.__path__)
    before = {m.model_type: registry.REGISTRY.get(m.model_type) for m in models}
    packages = [m.package for m in models]
    _drop_modules(packages)
    generated.__path__.append(str(root / "generated"))
    try:
        for m in models:
            registry.REGISTRY[m.model_type] = registry._record(m.record)
        yield
    finally:
        generated.__path__[:] = path
        for model_type, entry in before.items():
            if entry is None:
                registry.REGISTRY.pop(model_type, None)
            else:
                registry.REGISTRY[model_type] = entry
        _drop_modules(packages)
