"""A spec states what its class does not support, with the reason (`[model.unsupported]`), on the shipped Flux spec in
a temporary project: the record carries the reason, the runtime's refusal quotes it, and a suite's `require` skips
with it; without a reason `require` fails naming the key to add; a wrong table is refused in one line.

Before, a spec could not say why it lacked SP: a DiT without SP patches turned every SP suite red instead of being
skipped with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.spec_set import load_specs
from runtime.models import registry
from runtime.models.supports import layout_problems
from tests.engine.helpers import REPO, run_cli
from tests.supports import require

SPEC = (REPO / "specs/flux.toml").read_text()
REASON = "Flux's joint attention is not yet split over SP ranks (no dit/shard_tokens patches)"
FIRST_PATCH = '[[patch]]\ntemplate = "dit/shard_tokens"'
SHELL_PATCH = '[[patch]]\ntemplate = "dit/training_shell"'
CAPABILITIES_LINE = 'capabilities = ["guidance"]\n'


def shell_only(unsupported: str = "") -> str:
    """Flux without its SP patches (the token split, RoPE, Ulysses, ring, gather): only the trainable shell."""
    start, end = SPEC.index(FIRST_PATCH), SPEC.index(SHELL_PATCH)
    text = SPEC[:start] + SPEC[end:]
    return with_table(text, unsupported)


def with_table(text: str, unsupported: str) -> str:
    """`[model.unsupported]` (its body `unsupported`) right after the [model] keys, before [model.tiny]."""
    assert text.count(CAPABILITIES_LINE) == 1
    table = f"\n[model.unsupported]\n{unsupported}\n" if unsupported else ""
    return text.replace(CAPABILITIES_LINE, CAPABILITIES_LINE + table)


def project(tmp_path: Path, text: str) -> Path:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/flux.toml").write_text(text)
    return tmp_path


def regenerated(tmp_path: Path, capsys, text: str, monkeypatch: pytest.MonkeyPatch) -> registry.GeneratedModel:
    """`patchgen regen flux` in the temporary project; the registry's flux entry then is its record."""
    code, out, err = run_cli(project(tmp_path, text), capsys, "regen", "flux")
    assert code == 0, (out, err)
    entry = registry._record(tmp_path / "generated/flux_dit/transformer_flux.model.json")
    monkeypatch.setitem(registry.REGISTRY, "flux", entry)
    return entry


def load(tmp_path: Path, text: str) -> None:
    [spec] = load_specs(load_config(project(tmp_path, text)), ["flux"])
    assert spec.model is not None


def test_a_stated_reason_reaches_the_record_the_refusal_and_the_skip(tmp_path: Path, capsys, monkeypatch) -> None:
    entry = regenerated(tmp_path, capsys, shell_only(f'sp = "{REASON}"'), monkeypatch)
    record = json.loads((tmp_path / "generated/flux_dit/transformer_flux.model.json").read_text())
    assert record["supports"]["sp"] is False and record["supports"]["unsupported"] == {"sp": REASON}
    assert entry.supports.unsupported == {"sp": REASON} and not entry.supports.sp
    [problem] = layout_problems(entry, sp=2, ring=1, ep=1)
    assert problem.startswith("parallel.sp: 2 asks for sequence parallelism, but spec 'flux' applies no SP patch")
    assert problem.endswith(f"; specs/flux.toml states: {REASON}") and "\n" not in problem
    for capability in ("sp", "ring"):  # no ring without SP: the SP reason covers it
        with pytest.raises(pytest.skip.Exception) as skipped:
            require("flux", capability)
        assert str(skipped.value) == f"specs/flux.toml: no {capability}: {REASON}"
    with pytest.raises(pytest.fail.Exception, match=r"lacks ep .* add \[model.unsupported\] ep = "):
        require("flux", "ep")  # a DiT states no EP reason: a suite that asks for EP fails on it


def test_the_shipped_record_states_nothing_and_require_returns(monkeypatch) -> None:
    assert "unsupported" not in json.loads((REPO / "generated/flux_dit/transformer_flux.model.json").read_text())
    require("flux", "sp")
    require("flux", "ring")
    entry = registry.REGISTRY["flux"]
    monkeypatch.setitem(registry.REGISTRY, "flux", dataclasses.replace(entry, supports=registry.Supports()))
    with pytest.raises(pytest.fail.Exception):
        require("flux", "sp")


def test_a_missing_capability_without_a_reason_fails_naming_the_key(tmp_path: Path, capsys, monkeypatch) -> None:
    entry = regenerated(tmp_path, capsys, shell_only(), monkeypatch)
    assert "unsupported" not in json.loads((tmp_path / "generated/flux_dit/transformer_flux.model.json").read_text())
    [problem] = layout_problems(entry, sp=2, ring=1, ep=1)
    assert "states:" not in problem
    for capability in ("sp", "ring"):
        with pytest.raises(pytest.fail.Exception) as failed:
            require("flux", capability)
        [message] = str(failed.value).splitlines()
        assert message.startswith(f"specs/flux.toml: the generated class of 'flux' lacks {capability} ")
        assert message.endswith('add [model.unsupported] sp = "<why>" to specs/flux.toml, or the patches')


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            shell_only(f'tp = "{REASON}"'),
            "[model.unsupported] has unknown capability 'tp'; expected one of ['sp', 'ring', 'ep']: rename or remove "
            "the key",
        ),
        (
            shell_only('sp = "  "'),
            "[model.unsupported] key 'sp' must say in one line of at most 300 characters (no line breaks or control "
            "characters) why the class lacks sp, found 0 characters; state the reason, or remove the key",
        ),
        (
            with_table(SPEC, f'sp = "{REASON}"'),
            "[model.unsupported] key 'sp' says the class lacks sp, but its patches provide it (dit/shard_tokens); "
            "remove the key, or the patches",
        ),
        (
            with_table(SPEC, f'ring = "{REASON}"'),
            "[model.unsupported] key 'ring' says the class lacks ring, but its patches provide it (dit/ring_attention)"
            "; remove the key, or the patches",
        ),
    ],
    ids=["unknown_capability", "empty_reason", "contradiction_sp", "contradiction_ring"],
)
def test_a_wrong_unsupported_table_is_refused_in_one_line(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(PatchgenError) as err:
        load(tmp_path, text)
    [message] = str(err.value).splitlines()
    assert message == f"{tmp_path / 'specs/flux.toml'}: {expected}"


def test_a_reason_for_a_capability_the_patches_lack_loads(tmp_path: Path) -> None:
    load(tmp_path, with_table(SPEC, 'ep = "a dense DiT: no experts to place"'))
