"""Fixtures for the engine tests; the helpers themselves live in tests/engine/helpers.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.helpers import FixtureProject, make_project


@pytest.fixture
def project(tmp_path: Path) -> Callable[..., FixtureProject]:
    """`project(spec_text)` -> a fresh fixture project under tmp_path with that spec as specs/toy.toml."""
    counter = iter(range(1_000_000))

    def build(specs: dict[str, str] | str | None = None, pins: dict[str, str] | None = None) -> FixtureProject:
        return make_project(tmp_path / f"project{next(counter)}", specs, pins)

    return build
