"""What an anchor miss tells the user (issue 11, item 8): the nearest candidates for expression anchors too, and the
other scopes where the anchor does match (the usual mistake: the right code, the wrong `Class.method`)."""

from __future__ import annotations

import re
import shutil

import pytest

from patchgen.errors import PatchgenError
from tests.engine.helpers import REPO, TOY, run_cli, spec_toml, upstream_line

WRAP = dict(template="fx/wrap_guard", scope="ToyForTask.forward", anchor="self.loss_function", why="w")
INSERT = dict(
    template="fx/insert_code", scope="ToyLayer.forward", after="residual = hidden", vars=dict(code="nothing"), why="x"
)


def generate_error(project, patch: dict) -> str:
    proj = project(spec_toml(patches=[patch]))
    with pytest.raises(PatchgenError) as err:
        proj.generate()
    return str(err.value)


def candidates(message: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^ {4}line (\d+): (.*)$", message, re.M)]


@pytest.mark.parametrize("anchor", ["self.loss_functio", "self.los_function(out, labels)", "loss_func"])
def test_an_expression_anchor_miss_lists_the_nearest_candidates(project, anchor) -> None:
    message = generate_error(project, {**WRAP, "anchor": anchor})
    assert f"anchor {anchor!r} matches no expression in scope 'ToyForTask.forward'" in message
    found = candidates(message)
    assert found, message
    line = upstream_line(TOY, "loss = self.loss_function(out, labels)")
    assert (line, "self.loss_function") in found or (line, "self.loss_function(out, labels)") in found, found


def test_an_expression_anchor_in_another_scope_is_pointed_out(project) -> None:
    message = generate_error(project, {**WRAP, "scope": "ToyModel.forward"})
    assert "anchor 'self.loss_function' matches no expression in scope 'ToyModel.forward'" in message
    line = upstream_line(TOY, "loss = self.loss_function(out, labels)")
    assert f"\n  the anchor matches in another scope: ToyForTask.forward (line {line}); is 'scope' right?" in message


def test_a_statement_anchor_in_another_scope_is_pointed_out(project) -> None:
    message = generate_error(project, {**INSERT, "scope": "ToyModel.forward"})
    assert "anchor 'residual = hidden' matches no statement in scope 'ToyModel.forward'" in message
    line = upstream_line(TOY, "residual = hidden")
    assert f"\n  the anchor matches in another scope: ToyLayer.forward (line {line}); is 'scope' right?" in message


def test_a_missing_scope_points_to_where_the_anchor_is(project) -> None:
    message = generate_error(project, {**INSERT, "scope": "ToyLayerr.forward"})
    assert "no definition named 'ToyLayerr'" in message
    line = upstream_line(TOY, "residual = hidden")
    assert f"the anchor matches in another scope: ToyLayer.forward (line {line})" in message


def test_the_reported_case_a_vlm_mask_anchor_in_the_outer_model(tmp_path, capsys) -> None:
    """`create_causal_mask` lives in Qwen2_5_VLTextModel.forward; a spec naming Qwen2_5_VLModel.forward is told so."""
    root = tmp_path / "proj"
    root.mkdir()
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    for name in ("specs", "templates", "generated"):
        shutil.copytree(REPO / name, root / name)
    spec = root / "specs" / "qwen2_5_vl.toml"
    text = spec.read_text()
    wrong = text.replace(
        'scope = "Qwen2_5_VLTextModel.forward"\nanchor = "create_causal_mask"',
        'scope = "Qwen2_5_VLModel.forward"\nanchor = "create_causal_mask"',
        1,
    )
    assert wrong != text
    spec.write_text(wrong)
    code, _, err = run_cli(root, capsys, "regen", "qwen2_5_vl")
    assert code == 2
    assert "anchor 'create_causal_mask' matches no expression in scope 'Qwen2_5_VLModel.forward'" in err
    assert re.search(r"the anchor matches in another scope: Qwen2_5_VLTextModel\.forward \(line \d+\)", err), err
