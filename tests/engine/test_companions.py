"""Multi-module specs: a spec patches definitions its module imports from other modules of its distribution
(`[[companion]]`), generated beside its output with their own provenance, and every file of the set uses them.

The fixture model `fixturepkg.models.modeling_joint` imports its block from `blocks` and its attention processor
from `processors`; the block builds the processor itself (as diffusers' SD3 does with `JointTransformerBlock` and
`JointAttnProcessor2_0`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from patchgen import upstream
from patchgen.errors import PatchgenError
from patchgen.ownership import confinement
from patchgen.report import markdown
from patchgen.upgrade import analyze, apply
from patchgen.upstream import read_wheel
from tests.engine.helpers import (
    BLOCKS,
    JOINT,
    JOINT_OUTPUT,
    PROCESSORS,
    UPSTREAM_DIR,
    FixtureSource,
    body_of,
    build_wheel,
    joint_spec,
    run_cli,
    upstream_text,
)

BOOST = dict(template="core/add_parameter", scope="ToyProcessor.__call__", vars=dict(name="boost"), why="a new kwarg")
SCALE = dict(
    template="fx/scale_by",
    scope="ToyProcessor.__call__",
    after="scaled = [h * _SCALE for h in hidden]",
    vars=dict(target="scaled", factor="boost"),
    why="use it",
)


@pytest.fixture(autouse=True)
def installed_fixture(monkeypatch) -> None:
    """The CLI reads the pinned upstream as if the fixture package were installed."""
    monkeypatch.setattr(upstream, "InstalledSource", FixtureSource)


def generated_files(proj) -> dict[str, str]:
    return {one.relpath: one.text for one in proj.generate().files}


def test_a_scope_the_module_imports_says_to_declare_a_companion(project) -> None:
    """Before: "no definition named 'ToyProcessor' in the module" and the hint to copy the statement from upstream."""
    proj = project(joint_spec([BOOST], companions=[]))
    with pytest.raises(PatchgenError) as exc:
        proj.generate()
    message = str(exc.value)
    assert "no definition named 'ToyProcessor' in the module" in message
    assert f'declare [[companion]] module = "{PROCESSORS}", keep = ["ToyProcessor"]' in message
    assert "copy the statement from upstream" not in message


def test_companions_are_generated_beside_the_output_with_imports_repointed(project) -> None:
    files = generated_files(project(joint_spec([BOOST, SCALE])))
    assert list(files) == [JOINT_OUTPUT, "generated/joint/processors.py", "generated/joint/blocks.py"]
    main, processors, blocks = (body_of(text) for text in files.values())

    # the main module: the names a companion redefines come from it, the rest from upstream
    assert "from fixturepkg.models.blocks import ToyBlock" not in main
    assert (
        "# patchgen companion (1 stmt): ToyBlock redefined in generated.joint.blocks\n"
        "from generated.joint.blocks import ToyBlock\n"
    ) in main
    assert (
        "from fixturepkg.models.processors import OtherProcessor, ToyAttention\n"
        "# patchgen companion (1 stmt): ToyProcessor redefined in generated.joint.processors\n"
        "from generated.joint.processors import ToyProcessor\n"
    ) in main

    # a companion redefines its keep roots only: what they use is imported from upstream, and of the module-level
    # statements only those binding a used name stay
    assert "class ToyProcessor:" in processors
    assert "from fixturepkg.models.processors import ToyAttention\n" in processors  # an annotation uses it
    assert "_SCALE = 2.0" in processors
    for gone in ("class ToyAttention", "class OtherProcessor", "def describe", "BACKEND", "ALL_PROCESSORS"):
        assert gone not in processors
    assert "# patchgen #1 core/add_parameter (1 stmt): a new kwarg" in processors
    assert "def __call__(self, attn: ToyAttention, hidden, *args, boost=None, **kwargs):" in processors
    assert "# patchgen #2 fx/scale_by (1 stmt): use it" in processors

    assert "class ToyBlock:" in blocks and "class UnusedBlock" not in blocks
    assert "from fixturepkg.models.blocks import _residual\n" in blocks
    assert "from fixturepkg.models.processors import ToyAttention\n" in blocks
    assert "from generated.joint.processors import ToyProcessor\n" in blocks


def test_each_file_has_its_own_provenance_header_and_review_diff(project) -> None:
    gen = project(joint_spec([BOOST, SCALE])).generate()
    for one, module in zip(gen.files, (JOINT, PROCESSORS, BLOCKS), strict=True):
        relpath = module.replace(".", "/") + ".py"
        digest = hashlib.sha256(upstream_text(module).encode()).hexdigest()
        assert f"# upstream: fixturepkg==1.2.3 {relpath} sha256={digest}\n" in one.text
        assert one.diff.startswith(f"--- a/{relpath} (fixturepkg==1.2.3)\n+++ b/{one.relpath}\n")
    main_header, processors_header = (one.text.split("# ---- end")[0] for one in gen.files[:2])
    assert "#1 core/add_parameter" not in main_header and "#2 fx/scale_by" not in main_header
    assert "#   #1 core/add_parameter @ ToyProcessor.__call__: a new kwarg" in processors_header
    assert "#   #2 fx/scale_by @ ToyProcessor.__call__: use it" in processors_header


def test_the_generated_set_runs_the_redefinition_everywhere(project, capsys) -> None:
    """The blocks (companion) and the model's head (main module) both run the patched processor."""
    proj = project(joint_spec([BOOST, SCALE]))
    code, _, err = run_cli(proj.root, capsys, "regen", "--all")
    assert code == 0, err
    program = (
        "from generated.joint.modeling_joint import JointModel\n"
        "from fixturepkg.models.modeling_joint import JointModel as Upstream\n"
        "model = JointModel()\n"
        "print(model.forward([1.0, 2.0], boost=10.0), model.forward([1.0, 2.0]), Upstream().forward([1.0, 2.0], "
        "boost=10.0))\n"
        "print(type(model.blocks[0].attn.processor).__module__, type(model.head.processor).__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(proj.root), str(UPSTREAM_DIR)])}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=proj.root, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # block: h + 2*10*h = 21h, twice: 441h; head: 441h * 20 = 8820h. Without boost (and upstream): 3h, 9h, 18h.
    assert done.stdout.splitlines() == [
        "[8820.0, 17640.0] [18.0, 36.0] [18.0, 36.0]",
        "generated.joint.processors generated.joint.processors",
    ]


def test_upstream_code_that_builds_a_redefined_definition_is_refused(project) -> None:
    """The main module imports upstream's ToyBlock, which builds upstream's ToyProcessor: the patch would be
    silently bypassed. ToyAttention (imported too) only tests identity with ToyProcessor: that is fine."""
    proj = project(joint_spec([BOOST], companions=[(PROCESSORS, ["ToyProcessor"])]))
    with pytest.raises(PatchgenError) as exc:
        proj.generate()
    assert str(exc.value) == (
        f"{proj.root / 'specs/toy.toml'}: {JOINT_OUTPUT} imports ToyBlock from {BLOCKS} (upstream), whose "
        f"definition in {BLOCKS} uses ToyProcessor, which companion 'processors' redefines: upstream's ToyBlock "
        f"would run upstream's ToyProcessor, not the spec's. Redefine it too: declare [[companion]] module = "
        f'"{BLOCKS}", keep = ["ToyBlock"]'
    )


def test_a_scope_defined_in_two_modules_must_say_which(project) -> None:
    insert = dict(template="fx/insert_code", scope="describe", before='return "joint"', vars=dict(code="probe"))
    proj = project(joint_spec([{**insert, "why": "which describe?"}]))
    with pytest.raises(
        PatchgenError,
        match=r"describe is defined in modeling_joint and processors; say which, e\.g\. "
        r'scope = "processors:describe"',
    ):
        proj.generate()
    proj = project(joint_spec([{**insert, "scope": "modeling_joint:describe", "why": "the model's"}]))
    main, processors, _ = (body_of(one.text) for one in proj.generate().files)
    assert "probe = 1" in main and "def describe" not in processors


def test_a_qualified_scope_patches_the_companion(project) -> None:
    patch = dict(
        template="fx/insert_code",
        scope="processors:ToyProcessor.__call__",
        before="return scaled",
        vars=dict(code="probe"),
        why="qualified",
    )
    _, processors, _ = (body_of(one.text) for one in project(joint_spec([patch])).generate().files)
    assert "        probe = 1\n        return scaled" in processors


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            joint_spec([{**BOOST, "scope": "attention:ToyProcessor.__call__"}]),
            "patch 1 (core/add_parameter): scope 'attention:ToyProcessor.__call__': 'attention' is neither the "
            "spec's module nor a companion",
        ),
        (joint_spec(companions=[("os.path", ["join"])]), "companion 1: module 'os.path' must be another module of"),
        (joint_spec(companions=[(JOINT, ["JointModel"])]), "must be another module of 'fixturepkg'"),
        (joint_spec(companions=[("fixturepkg.other.modeling_joint", ["X"])]), "its last component 'modeling_joint'"),
        (joint_spec(companions=[(PROCESSORS, [])]), "'keep' must name the definitions"),
        (
            joint_spec() + '\n[[companion]]\nmodule = "fixturepkg.util"\nkeep = ["clamp"]\nexclude = []\n',
            "unknown key",
        ),
    ],
)
def test_companion_tables_are_validated(project, text: str, message: str) -> None:
    proj = project(text)
    with pytest.raises(PatchgenError, match=message.replace("(", r"\(").replace(")", r"\)")):
        proj.spec()


def test_a_companion_keep_root_must_exist(project) -> None:
    proj = project(joint_spec(companions=[(PROCESSORS, ["ToyProcessor", "Missing"])]))
    with pytest.raises(PatchgenError, match=r"companion 'fixturepkg.models.processors' keep names \['Missing'\]"):
        proj.generate()


def test_check_drift_and_orphans_cover_companion_files(project, capsys) -> None:
    proj = project(joint_spec([BOOST, SCALE]))
    assert run_cli(proj.root, capsys, "regen", "--all")[0] == 0
    assert run_cli(proj.root, capsys, "check")[:2] == (0, "ok: 1 spec(s) match generated/\n")
    assert run_cli(proj.root, capsys, "check", "--full")[0] == 0
    companion = proj.root / "generated/joint/processors.py"
    companion.write_text(companion.read_text() + "# edited\n")
    code, _, err = run_cli(proj.root, capsys, "check")
    assert code == 1 and "DRIFT generated/joint/processors.py: edited by hand" in err
    assert run_cli(proj.root, capsys, "regen", "toy")[0] == 0
    (proj.root / "generated/joint/blocks.py.diff").write_text("stale\n")
    code, _, err = run_cli(proj.root, capsys, "check")
    assert code == 1 and "DRIFT generated/joint/blocks.py.diff: review diff missing or stale" in err
    assert run_cli(proj.root, capsys, "regen", "toy")[0] == 0
    (proj.root / "generated/joint/processors.model.json").write_text("{}\n")  # a companion has no model record
    code, _, err = run_cli(proj.root, capsys, "check")
    assert code == 1 and "DRIFT generated/joint/processors.model.json: no spec owns it" in err
    (proj.root / "generated/joint/processors.model.json").unlink()
    (proj.root / "generated/joint/blocks.py").unlink()
    code, _, err = run_cli(proj.root, capsys, "check")
    assert code == 1 and "DRIFT generated/joint/blocks.py: missing; run `patchgen regen toy`" in err


def test_a_journaled_write_may_name_companion_outputs_inherited_ones_too(project) -> None:
    proj = project(
        {
            "toy": joint_spec([BOOST, SCALE]),
            "heir": f'extends = "toy"\nmodule = "{JOINT}"\noutput = "generated/heir/m.py"\n',
        }
    )
    owned = {p.relative_to(proj.root).as_posix() for p in confinement(proj.config).outputs}
    for folder in ("joint", "heir"):
        assert {f"generated/{folder}/processors.py", f"generated/{folder}/processors.py.diff"} <= owned
        assert {f"generated/{folder}/blocks.py", f"generated/{folder}/blocks.py.diff"} <= owned
        assert f"generated/{folder}/processors.model.json" not in owned
    assert [c.output for c in proj.spec("heir").companions] == [
        "generated/heir/processors.py",
        "generated/heir/blocks.py",
    ]


def test_the_model_record_names_the_companion_modules(project, capsys) -> None:
    model = (
        '\n[model]\nmodel_type = "joint"\nclass = "JointModel"\nupstream = "fixturepkg.JointModel"\nfamily = "dit"\n'
    )
    proj = project(joint_spec([BOOST]) + model)
    assert run_cli(proj.root, capsys, "regen", "--all")[0] == 0
    record = json.loads((proj.root / "generated/joint/modeling_joint.model.json").read_text())
    assert record["module"] == "generated.joint.modeling_joint"
    assert record["companions"] == ["generated.joint.processors", "generated.joint.blocks"]


def test_list_explain_and_diff_cover_the_companions(project, capsys) -> None:
    proj = project(joint_spec([BOOST, SCALE]))
    code, out, _ = run_cli(proj.root, capsys, "list")
    assert code == 0 and f"{JOINT_OUTPUT} (+ processors.py, blocks.py)  (2 patches)" in out
    code, out, _ = run_cli(proj.root, capsys, "explain", "toy")
    assert code == 0
    assert f"  companion {PROCESSORS} -> generated/joint/processors.py (redefines ToyProcessor)" in out
    line = next(no for no, text in enumerate(upstream_text(PROCESSORS).splitlines(), 1) if "scaled = [h" in text)
    assert (
        f"#2 fx/scale_by (op insert) @ processors:ToyProcessor.__call__, upstream line {line} of "
        f"fixturepkg/models/processors.py"
    ) in out
    code, out, _ = run_cli(proj.root, capsys, "diff", "toy")
    assert code == 0
    for relpath, output in (
        ("fixturepkg/models/modeling_joint.py", JOINT_OUTPUT),
        ("fixturepkg/models/processors.py", "generated/joint/processors.py"),
        ("fixturepkg/models/blocks.py", "generated/joint/blocks.py"),
    ):
        assert f"--- a/{relpath} (fixturepkg==1.2.3)\n+++ b/{output}\n" in out


def test_upgrade_reports_each_companion_patch_and_applies_every_file(project, tmp_path) -> None:
    proj = project(joint_spec([BOOST, SCALE]))
    text = upstream_text(PROCESSORS)
    moved = text.replace("scaled = [h * _SCALE for h in hidden]", "scaled = [h * _SCALE * 1.0 for h in hidden]")
    shifted = text.replace('"""Shared attention', '"""Shared (and shifted)\nattention')
    for version, processors, statuses in (("2.0.0", moved, ["applied", "anchor moved"]), ("2.1.0", shifted, None)):
        wheel = read_wheel(build_wheel(tmp_path / "wheels", version, {PROCESSORS: processors}))
        result = analyze(proj.config, [proj.spec()], [wheel], FixtureSource())
        [model] = result.models
        if statuses is not None:
            assert [s.status for s in model.patches] == statuses
            assert not result.ok
            continue
        assert result.ok
        assert [r.scope for r in model.regions] == ["processors:ToyProcessor.__call__"]
        assert [s.scope for s in model.patches] == ["processors:ToyProcessor.__call__"] * 2
        line = next(no for no, t in enumerate(shifted.splitlines(), 1) if "def __call__(self, attn: ToyAttention" in t)
        assert model.patches[0].detail == f"line {line} (was {line - 1})"
        report = markdown(result)
        assert f"- companion `{PROCESSORS}`: output `generated/joint/processors.py` (redefines ToyProcessor)" in report
        changed = apply(proj.config, result)
    written = {p.relative_to(proj.root).as_posix() for p in changed}
    assert {"generated/joint/processors.py", "generated/joint/blocks.py", JOINT_OUTPUT, "pyproject.toml"} <= written
    header = (proj.root / "generated/joint/processors.py").read_text().split("# ---- end")[0]
    assert "# upstream: fixturepkg==2.1.0 fixturepkg/models/processors.py sha256=" in header
