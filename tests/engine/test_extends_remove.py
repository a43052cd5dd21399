"""`remove`: a spec that `extends` another drops inherited `[model]` keys (issue 19, item 8).

Before, a Mixtral spec extending qwen3_moe carried qwen3_moe's `num_experts` in its tiny config, a key Mixtral's
config ignores (it reads `num_local_experts`), so a later edit of it silently did nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.spec_set import load_specs
from tests.engine.helpers import REPO, run_cli

MIXTRAL = """\
extends = "qwen3_moe"
module = "transformers.models.mixtral.modeling_mixtral"
output = "generated/mixtral/modeling_mixtral.py"
class_prefix = { from = "Qwen3Moe", to = "Mixtral" }
remove = [REMOVE]

[model]
model_type = "mixtral"

[model.tiny]
num_local_experts = 8
"""
DOTTED = 'expected a dotted key of the inherited [model] table, e.g. "model.tiny.num_experts"'


def project_with(tmp_path: Path, remove: str = '"model.tiny.num_experts"', extra: str = "") -> Path:
    for name in ("pyproject.toml", "templates"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    (tmp_path / "specs").mkdir()
    shutil.copy(REPO / "specs/qwen3_moe.toml", tmp_path / "specs/qwen3_moe.toml")
    (tmp_path / "specs/mixtral.toml").write_text(MIXTRAL.replace("REMOVE", remove) + extra)
    return tmp_path


def mixtral(root: Path):
    config = load_config(root)
    [spec] = load_specs(config, ["mixtral"])
    return spec


def test_a_mixtral_like_spec_drops_the_inherited_num_experts(tmp_path) -> None:
    spec = mixtral(project_with(tmp_path))
    [base] = load_specs(load_config(tmp_path), ["qwen3_moe"])
    assert "num_experts" in base.model.tiny
    assert "num_experts" not in spec.model.tiny
    assert spec.model.tiny["num_local_experts"] == 8
    assert spec.model.tiny["hidden_size"] == base.model.tiny["hidden_size"]  # everything else is inherited
    assert spec.model.cls == "MixtralForCausalLM" and spec.model.model_type == "mixtral"


def test_removing_a_whole_inherited_table(tmp_path) -> None:
    spec = mixtral(project_with(tmp_path, '"model.capabilities"'))
    assert spec.model.capabilities == ()


@pytest.mark.parametrize(
    ("remove", "extra", "message"),
    [
        (
            '"model.tiny.num_expert"',
            "",
            "'remove' entry 'model.tiny.num_expert': qwen3_moe.toml (and what it extends) has no such key; remove "
            "only what is inherited",
        ),
        (
            '"tiny.num_experts"',
            "",
            "'remove' entry 'tiny.num_experts': " + DOTTED,
        ),
        (
            '"model"',
            "",
            "'remove' entry 'model': " + DOTTED,
        ),
        (
            '"model.tiny.num_experts"',
            "num_experts = 4\n",
            "'remove' entry 'model.tiny.num_experts': this spec sets that key again; either remove it or set it",
        ),
        (
            "1",
            "",
            "'remove' entry 1: " + DOTTED,
        ),
    ],
)
def test_a_wrong_removal_is_one_line_naming_the_entry(tmp_path, remove: str, extra: str, message: str) -> None:
    root = project_with(tmp_path, remove, extra)
    with pytest.raises(PatchgenError) as exc:
        mixtral(root)
    assert str(exc.value) == f"{root / 'specs/mixtral.toml'}: {message}"


def test_remove_needs_extends(tmp_path, capsys) -> None:
    root = project_with(tmp_path)
    (root / "specs/qwen3_moe.toml").write_text(
        'remove = ["model.tiny.x"]\n' + (REPO / "specs/qwen3_moe.toml").read_text()
    )
    code, _, err = run_cli(root, capsys, "list")
    assert (code, err) == (
        2,
        f"error: {root / 'specs/qwen3_moe.toml'}: remove drops keys of what a spec inherits; it needs 'extends'\n",
    )


def test_an_inherited_patchs_error_names_the_base_spec_that_states_it(tmp_path: Path) -> None:
    """A bad value in qwen3.toml's patch, loaded through qwen2.toml (which extends qwen3), is reported against
    qwen3.toml (the file to edit) and says which child inherits it; before, the error named qwen2.toml."""
    for name in ("pyproject.toml", "templates"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    (tmp_path / "specs").mkdir()
    for name in ("qwen2", "qwen3"):
        shutil.copy(REPO / f"specs/{name}.toml", tmp_path / f"specs/{name}.toml")
    base = tmp_path / "specs/qwen3.toml"
    anchor = 'anchor = "create_causal_mask"\n'
    assert anchor in base.read_text()
    base.write_text(base.read_text().replace(anchor, anchor + 'vars = { position_ids = "import os" }\n', 1))
    with pytest.raises(PatchgenError) as err:
        load_specs(load_config(tmp_path), ["qwen2"])
    message = str(err.value)
    assert message.startswith(f"{base}: patch 1 (inherited by qwen2.toml as patch 1) (sp/full_sequence_mask): "), (
        message
    )
    assert "vars.position_ids must be" in message
