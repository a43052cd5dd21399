"""Wheels are trusted by content, not by name (issue 11, item 6): `[tool.patchgen.wheel_sha256]` records the sha256
of every release wheel patchgen may read; a wheel given with `--from`/`--to`, found in the wheel cache or downloaded
is checked against it before anything in it is read."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest

from patchgen import wheels
from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.wheels import wheel_cache
from tests.engine.helpers import (
    ALL_OPS,
    REPO,
    TOY,
    VERSION,
    build_wheel,
    record_wheel,
    run_cli,
    spec_toml,
    upstream_text,
)

EVIL = upstream_text(TOY).replace("def rescale(x, factor=1.0):\n", "def rescale(x, factor=1.0):\n    import os\n", 1)


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def generated(project, capsys):
    """A fixture project generated from the genuine 1.2.3 wheel, which sits in its wheel cache."""
    proj = project(spec_toml(patches=ALL_OPS))
    build_wheel(wheel_cache(proj.root), VERSION)
    code, _, err = run_cli(proj.root, capsys, "regen", "--all", "--from", f"fixturepkg=={VERSION}")
    assert code == 0, err
    return proj


def test_a_tampered_wheel_given_with_from_is_refused(generated, tmp_path, capsys) -> None:
    tampered = build_wheel(tmp_path / "elsewhere", VERSION, {TOY: EVIL})
    before = snapshot(generated.root)
    for command in ("regen", "check"):
        code, _, err = run_cli(
            generated.root, capsys, command, "--all" if command == "regen" else "--full", "--from", str(tampered)
        )
        assert code == 2, (command, err)
        actual = hashlib.sha256(tampered.read_bytes()).hexdigest()
        assert err.startswith(f"error: {tampered}: sha256 {actual} is not the recorded sha256 of fixturepkg==1.2.3"), (
            err
        )
        assert "Traceback" not in err
    assert snapshot(generated.root) == before


def test_a_tampered_wheel_in_the_cache_is_refused(generated, capsys) -> None:
    cached = wheel_cache(generated.root) / f"fixturepkg-{VERSION}-py3-none-any.whl"
    build_wheel(cached.parent, VERSION, {TOY: EVIL})  # same name, other bytes
    code, _, err = run_cli(generated.root, capsys, "check", "--from", f"fixturepkg=={VERSION}")
    assert code == 2 and "is not the recorded sha256 of fixturepkg==1.2.3" in err, err
    assert "delete it from the wheel cache" in err


def test_a_wheel_of_a_release_without_a_recorded_hash_is_refused_until_recorded(generated, capsys) -> None:
    other = build_wheel(wheel_cache(generated.root), "2.0.0")
    code, _, err = run_cli(generated.root, capsys, "upgrade", "--to", "fixturepkg==2.0.0")
    actual = hashlib.sha256(other.read_bytes()).hexdigest()
    assert code == 2 and f"no sha256 recorded for fixturepkg==2.0.0 (this file's is {actual})" in err, err
    assert f'"fixturepkg==2.0.0" = "{actual}"' in err and "[tool.patchgen.wheel_sha256]" in err
    record_wheel(generated.root, other)
    code, out, err = run_cli(generated.root, capsys, "upgrade", "--to", "fixturepkg==2.0.0")
    assert code == 0, err


def test_a_downloaded_wheel_is_checked_too(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"

    def download(package: str, version: str, into: Path) -> Path:
        return build_wheel(into, version, {TOY: EVIL})

    monkeypatch.setattr(wheels, "download_wheel", download)
    genuine = hashlib.sha256(build_wheel(tmp_path / "genuine", VERSION).read_bytes()).hexdigest()
    with pytest.raises(PatchgenError, match="is not the recorded sha256 of fixturepkg==1.2.3"):
        wheels.obtain(wheels.parse_target(f"fixturepkg=={VERSION}"), cache, {f"fixturepkg=={VERSION}": {genuine}})


@pytest.mark.parametrize(
    "table, message",
    [
        ('"fixturepkg" = "ab"', "keys are exact releases 'package==version'"),
        ('"fixturepkg==1.2.3" = "abc"', "values are sha256 hex digests"),
        ('"fixturepkg==1.2.3" = 3', "values are sha256 hex digests"),
    ],
)
def test_malformed_wheel_hashes_are_a_config_error(project, table, message) -> None:
    proj = project(spec_toml())
    pyproject = proj.root / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(
        text[: text.index("[tool.patchgen.wheel_sha256]")] + f"[tool.patchgen.wheel_sha256]\n{table}\n"
    )
    with pytest.raises(PatchgenError, match=r"pyproject.toml: \[tool.patchgen.wheel_sha256\]: " + message):
        load_config(proj.root)


def test_the_project_records_every_pinned_and_upgrade_target_release() -> None:
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["patchgen"]
    recorded = table["wheel_sha256"]
    for package, version in table["pins"].items():
        assert f"{package}=={version}" in recorded
    assert {"transformers==5.23.0", "diffusers==0.42.1"} <= set(recorded)
    for path in sorted(wheel_cache(REPO).glob("*.whl")):  # the downloaded wheels, where this clone has them
        pin = "{}=={}".format(*path.name.split("-")[:2])
        assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded[pin], path
