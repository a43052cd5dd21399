"""`patchgen upgrade` on fixtures: two versions of the fixture upstream, packed as real (tiny) wheels.

Version 2.0.0 shifts lines, renames a class, removes a method, changes a signature, edits an anchored statement
and moves a statement into a replaced run. Every test runs offline: `wheels.download_wheel` is replaced by one
that fails, so the wheels must come from the project's cache (or a path).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from patchgen import wheels
from patchgen.config import with_pins
from patchgen.cst.plan import resolve_each
from patchgen.errors import PatchgenError
from patchgen.generate import parse_upstream
from patchgen.header import split
from patchgen.spec_set import load_specs
from patchgen.upgrade import analyze
from patchgen.upstream import WheelSource, read_wheel
from patchgen.wheels import wheel_cache
from tests.engine.helpers import (
    REPO,
    TOY,
    FixtureSource,
    build_wheel,
    make_project,
    record_wheel,
    spec_toml,
    upstream_line,
    upstream_text,
)

V1, V2 = "1.2.3", "2.0.0"
INSERT_CODE = dict(
    template="fx/insert_code", scope="ToyLayer.forward", after="residual = hidden", vars=dict(code="nothing"), why="x"
)


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def toy_v2() -> str:
    text = upstream_text(TOY)
    text = _replace_once(
        text,
        "EPS   =   1e-6  # odd spacing kept verbatim\n",  # every line below moves down
        "EPS   =   1e-6  # odd spacing kept verbatim\nSCALE = 2.0\n\n\ndef new_helper(x):\n    return x * SCALE\n",
    )
    text = text.replace("ToyLayer", "ToyDecoderLayer")  # a renamed class
    text = _replace_once(
        text, "    @staticmethod\n    def default_mask(length):\n        return [1.0] * length\n\n", ""
    )  # a removed method ...
    text = _replace_once(
        text, "attention_mask = self.default_mask(len(hidden))", "attention_mask = [1.0] * len(hidden)"
    )  # ... and its caller
    text = _replace_once(
        text,
        "norm = math.sqrt(sum(h * h for h in hidden) + EPS)",
        "norm = math.sqrt(sum(h * h for h in hidden) + EPS * len(hidden))",
    )  # an edited anchor
    text = _replace_once(
        text, "def forward(self, hidden, labels=None):", "def forward(self, hidden, labels=None, **kwargs):"
    )  # a changed signature
    return _replace_once(
        text,
        "        loss = None\n        if labels is not None:\n            loss = self.loss_function(out, labels)\n",
        "        aux = self.loss_function(out, labels) if labels is not None else None\n"
        "        loss = None\n        if labels is not None:\n            loss = aux\n",
    )


PATCHES = [
    dict(
        template="fx/insert_code",
        scope="ToyModel.forward",
        before="if attention_mask is None:",
        vars=dict(code="hidden_list"),
        why="only its line moves",
    ),
    dict(
        template="fx/replace_rescale",
        scope="ToyLayer.forward",
        anchor="hidden = rescale(hidden, factor=self.config.scale)",
        vars=dict(factor=2.0),
        why="class renamed",
    ),
    dict(template="fx/replace_method", scope="ToyModel.default_mask", why="method removed"),
    dict(
        template="fx/insert_code",
        scope="ToyForTask",
        before="def forward(self, hidden, labels=None):",
        vars=dict(code="labels_const"),
        why="signature changed",
    ),
    dict(
        template="fx/replace_code",
        scope="ToyForTask.forward",
        anchor="out = super().forward(hidden)",
        through="loss = None",
        vars=dict(code="super_forward"),
        why="run grew",
    ),
    dict(
        template="fx/wrap_guard",
        scope="ToyForTask.forward",
        anchor="self.loss_function",
        why="now inside patch 5's run",
    ),
    dict(
        template="fx/add_definition", scope="<module>", vars=dict(name="bounded", low=-1.0, high=1.0), why="appended"
    ),
    dict(template="fx/replace_definition", scope="rescale", vars=dict(gain=3), why="unchanged upstream"),
    dict(
        template="fx/insert_code",
        scope="ToyModel.forward",
        after="norm = math.sqrt(sum(h * h for h in hidden) + EPS)",
        vars=dict(code="norm_default"),
        why="anchor edited upstream",
    ),
]
EXPECTED = {
    1: "applied",
    2: "scope missing",
    3: "scope missing",
    4: "anchor moved",
    5: "replaced code changed",
    6: "conflict",
    7: "applied",
    8: "applied",
    9: "anchor moved",
}
APPLYING = [PATCHES[i - 1] for i, status in EXPECTED.items() if status in ("applied", "replaced code changed")]


def v2_line(snippet: str) -> int:
    hits = [no for no, line in enumerate(toy_v2().splitlines(), start=1) if snippet in line]
    assert len(hits) == 1, (snippet, hits)
    return hits[0]


def cli(root: Path, capsys, *args: str) -> tuple[int, str, str]:
    """`patchgen <args> --root <root>` through cli.main, in this process (so monkeypatches hold)."""
    from patchgen.cli import main

    argv = sys.argv
    sys.argv = ["patchgen", *args, "--root", str(root)]
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.fixture
def downloads(monkeypatch) -> list[str]:
    """No network: every download attempt is recorded and fails."""
    attempts: list[str] = []

    def offline(package: str, version: str, cache: Path) -> Path:
        attempts.append(f"{package}=={version}")
        raise PatchgenError(f"cannot download {package}=={version}: network unavailable")

    monkeypatch.setattr(wheels, "download_wheel", offline)
    return attempts


def upgrade_project(root: Path, capsys, patches: list[dict] = PATCHES):
    """A project generated from the 1.2.3 wheel (`regen --from`), with both wheels in its wheel cache."""
    proj = make_project(root, spec_toml(patches=patches))
    build_wheel(wheel_cache(proj.root), V1)
    record_wheel(proj.root, build_wheel(wheel_cache(proj.root), V2, {TOY: toy_v2()}))
    code, _, err = cli(proj.root, capsys, "regen", "--all", "--from", f"fixturepkg=={V1}")
    assert code == 0, err
    return proj


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---- statuses ------------------------------------------------------------------------------------------------


def test_each_patch_gets_its_status_and_the_new_file_keeps_only_what_applies(tmp_path, capsys, downloads) -> None:
    proj = upgrade_project(tmp_path / "proj", capsys)
    cache = wheel_cache(proj.root)
    old, new = (
        read_wheel(cache / f"fixturepkg-{V1}-py3-none-any.whl"),
        read_wheel(cache / f"fixturepkg-{V2}-py3-none-any.whl"),
    )
    result = analyze(proj.config, load_specs(proj.config, None), [new], WheelSource([old]))
    [model] = result.models
    status = {s.patch.index: s for s in model.patches}
    assert {i: s.status for i, s in status.items()} == EXPECTED
    assert not model.ok and not result.ok

    was = upstream_line(TOY, "if attention_mask is None:")
    assert status[1].detail == f"line {v2_line('if attention_mask is None:')} (was {was})"
    assert status[2].candidates[0] == (v2_line("class ToyDecoderLayer:"), "ToyDecoderLayer")
    assert "no definition named 'default_mask' in ToyModel" in status[3].detail
    assert status[4].candidates[0] == (
        v2_line("def forward(self, hidden, labels=None, **kwargs):"),
        "def forward(self, hidden, labels=None, **kwargs):",
    )
    assert status[5].detail.startswith(
        f"line {v2_line('out = super().forward(hidden)')} (was "
        f"{upstream_line(TOY, 'out = super().forward(hidden)')}); the upstream code "
        f"it replaces changed"
    )
    assert status[6].detail.startswith("conflicts with patch 5 (fx/replace_code)")
    assert status[7].detail == "end of module"
    assert status[8].detail == f"line {v2_line('def rescale(')} (was {upstream_line(TOY, 'def rescale(')})"
    assert status[9].candidates[0] == (
        v2_line("norm = math.sqrt("),
        "norm = math.sqrt(sum((h * h for h in hidden)) + EPS * len(hidden))",
    )

    # the review file is built from the patches that apply, and says so in its header
    text = model.generated.text
    compile(text, "modeling_toy.py", "exec")
    header = text[: len(text) - len(split(text)[1])]
    listed = re.findall(r"^#   #(\d+) ", header, re.M)
    assert listed == ["1", "5", "7", "8"]
    assert {int(m) for m in re.findall(r"^ *# patchgen #(\d+) ", text, re.M)} == {1, 5, 7, 8}
    assert "upstream: fixturepkg==2.0.0 " in text


def hunks_match_the_files(diff: str, old: str, new: str) -> int:
    """Every hunk's line numbers point at its lines in the full old and new files; returns the hunk count."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    count = 0
    for hunk in re.split(r"^(?=@@ )", diff, flags=re.M)[1:]:
        header, *body = hunk.splitlines()
        old_at, new_at = (int(n) for n in re.match(r"@@ -(\d+)(?:,\d+)? \+(\d+)", header).groups())
        olds = [line[1:] for line in body if line[:1] in " -"]
        news = [line[1:] for line in body if line[:1] in " +"]
        assert old_lines[old_at - 1 : old_at - 1 + len(olds)] == olds, header
        assert new_lines[new_at - 1 : new_at - 1 + len(news)] == news, header
        count += 1
    return count


def test_upstream_diff_of_each_patched_region(tmp_path, capsys, downloads) -> None:
    proj = upgrade_project(tmp_path / "proj", capsys)
    cache = wheel_cache(proj.root)
    wheels_ = [read_wheel(p) for p in sorted(cache.glob("*.whl"))]
    result = analyze(proj.config, load_specs(proj.config, None), [wheels_[1]], WheelSource([wheels_[0]]))
    regions = {r.scope: r for r in result.models[0].regions}
    assert list(regions) == [
        "ToyModel.forward",
        "ToyLayer.forward",
        "ToyModel.default_mask",
        "ToyForTask",
        "ToyForTask.forward",
        "rescale",
    ]  # once per scope, in patch order
    forward = regions["ToyForTask.forward"]
    assert forward.old_lines == (
        upstream_line(TOY, "def forward(self, hidden, labels=None):"),
        upstream_line(TOY, "return out, loss"),
    )
    assert (
        "-    def forward(self, hidden, labels=None):\n+    def forward(self, hidden, labels=None, **kwargs):\n"
        in forward.diff
    )
    assert "+        aux = self.loss_function(out, labels) if labels is not None else None\n" in forward.diff
    assert hunks_match_the_files(forward.diff, upstream_text(TOY), toy_v2()) == 1
    assert hunks_match_the_files(regions["ToyModel.forward"].diff, upstream_text(TOY), toy_v2()) == 1
    renamed = regions["ToyLayer.forward"]  # compared with the renamed class's method: same text
    assert (renamed.near, renamed.diff) == ("ToyDecoderLayer.forward", "")
    assert renamed.new_lines[0] == v2_line("@traced")  # a region starts at its decorators
    assert regions["ToyModel.default_mask"].new_lines is None
    assert regions["rescale"].diff == "" and regions["rescale"].old_lines != regions["rescale"].new_lines


def test_resolve_each_records_every_failure_and_keeps_the_rest(project) -> None:
    ok = dict(
        template="fx/insert_trace",
        scope="ToyLayer.forward",
        after="residual = hidden",
        vars=dict(name="t"),
        why="applies",
    )
    failing = [
        (
            dict(
                template="fx/bad_syntax",
                scope="ToyModel.forward",
                before="return [h / norm for h in hidden]",
                vars=dict(cond="ready"),
                why="x",
            ),
            "render error",
        ),
        (dict(template="fx/add_method", scope="rescale", vars=dict(name="extra"), why="x"), "scope mismatch"),
        (dict(template="fx/add_method", scope="ToyModel", vars=dict(name="forward"), why="x"), "conflict"),
        ({**INSERT_CODE, "scope": "<module>", "after": "self.config = config"}, "anchor ambiguous"),
        ({**INSERT_CODE, "after": "if attention_mask is not None"}, "invalid anchor"),
        ({**INSERT_CODE, "scope": "ToyModle.forward"}, "scope missing"),
        ({**INSERT_CODE, "after": "residual = hiden"}, "anchor moved"),
    ]
    proj = project(spec_toml(patches=[f for f, _ in failing] + [ok]))
    spec = proj.spec()
    plan, errors = resolve_each(parse_upstream(FixtureSource().read(TOY)), spec.patches)
    assert [(e.patch.index, e.kind) for e in errors] == [(i, k) for i, (_, k) in enumerate(failing, start=1)]
    assert {e.patch.index for e in plan.edits} == {len(failing) + 1}
    assert plan.imports == ["import logging", "from fixturepkg.extra import trace_event"]
    assert len(plan.rendered) == 1


# ---- the command ---------------------------------------------------------------------------------------------


def test_upgrade_reports_refuses_apply_and_leaves_nothing_behind(tmp_path, capsys, downloads) -> None:
    proj = upgrade_project(tmp_path / "proj", capsys)
    before = snapshot(proj.root)
    report = tmp_path / "docs" / "fixturepkg-2.0.0.md"
    code, out, err = cli(proj.root, capsys, "upgrade", "--to", f"fixturepkg=={V2}", "--apply", "--report", str(report))
    assert code == 1, err
    assert "--apply refused: not every patch applies; nothing under generated/ or in pyproject.toml changed" in err
    for index, expected in EXPECTED.items():
        patch = PATCHES[index - 1]
        assert re.search(
            rf"^toy +#{index} {re.escape(patch['template'])} +{re.escape(patch['scope'])} +"
            rf"{re.escape(expected)} ",
            out,
            re.M,
        ), (index, out)
    assert "4 of 9 patches apply in 1 model(s); not applying: toy" in out
    assert "fixturepkg-2.0.0-py3-none-any.whl cached" in out and "(pinned baseline)" not in out

    after = snapshot(proj.root)
    review = "upgrade-review/fixturepkg-2.0.0/"
    assert {k for k in after if k not in before} == {
        review + "REPORT.md",
        review + "generated/toy/modeling_toy.py",
        review + "generated/toy/modeling_toy.py.diff",
    }
    assert all(after[k] == before[k] for k in before)  # generated/, pyproject.toml, specs, cache: untouched
    markdown = (proj.root / review / "REPORT.md").read_text()
    # the --report copy links the whole generated-file diff, written beside it, where the review copy inlines it
    diff = (tmp_path / "docs" / "fixturepkg-2.0.0" / "toy.diff").read_text()
    assert diff.startswith("--- ") and diff in markdown
    assert (
        "[fixturepkg-2.0.0/toy.diff](fixturepkg-2.0.0/toy.diff)" in report.read_text()
        and diff not in report.read_text()
    )
    assert str(tmp_path) not in markdown and "| toy | #6 fx/wrap_guard | ToyForTask.forward | conflict |" in markdown
    assert markdown.startswith(
        "# Upgrade review: fixturepkg 1.2.3 -> 2.0.0\n\nMade by `patchgen upgrade --to fixturepkg==2.0.0`"
    )

    # a fresh run, from another copy of the project, writes the same report; still no download
    other = upgrade_project(tmp_path / "elsewhere" / "copy", capsys)
    code, _, _ = cli(
        other.root, capsys, "upgrade", "--to", str(wheel_cache(proj.root) / "fixturepkg-2.0.0-py3-none-any.whl")
    )
    assert code == 1
    assert (other.root / review / "REPORT.md").read_text() == markdown
    assert downloads == []


def test_apply_writes_generated_files_and_pins_when_every_patch_applies(tmp_path, capsys, downloads) -> None:
    proj = upgrade_project(tmp_path / "proj", capsys, APPLYING)
    code, out, err = cli(proj.root, capsys, "upgrade", "--to", f"fixturepkg=={V2}", "--apply")
    assert code == 0, err
    assert "  wrote  generated/toy/modeling_toy.py\n" in out and "  wrote  pyproject.toml\n" in out
    assert tomllib.loads((proj.root / "pyproject.toml").read_text())["tool"]["patchgen"]["pins"] == {"fixturepkg": V2}
    generated = (proj.root / "generated/toy/modeling_toy.py").read_text()
    assert "# upstream: fixturepkg==2.0.0 fixturepkg/models/modeling_toy.py" in generated
    assert generated == (proj.root / "upgrade-review/fixturepkg-2.0.0/generated/toy/modeling_toy.py").read_text()
    # the new pin is verified from its wheel until it is installed; the old release is refused now
    assert cli(proj.root, capsys, "check", "--from", f"fixturepkg=={V2}")[0] == 0
    assert cli(proj.root, capsys, "check", "--full", "--from", f"fixturepkg=={V2}")[0] == 0
    code, _, err = cli(proj.root, capsys, "regen", "--all", "--from", f"fixturepkg=={V1}")
    assert code == 2 and "is fixturepkg==1.2.3 but the pin is fixturepkg==2.0.0" in err
    code, _, err = cli(proj.root, capsys, "check")
    assert code == 2 and "'fixturepkg' is not installed" in err
    assert downloads == []


def test_user_errors_exit_2_and_write_nothing(tmp_path, capsys, downloads) -> None:
    proj = upgrade_project(tmp_path / "proj", capsys)
    (wheel_cache(proj.root) / "broken.whl").write_bytes(b"not a zip")
    before = snapshot(proj.root)
    for args, message in [
        (("--to", "fixturepkg>=2"), "expected an exact release `package==version`"),
        (("--to", "torch==2.13.0"), "unknown package 'torch'; the pinned upstream packages are fixturepkg"),
        (("--to", "fixturepkg==9.9.9"), "no sha256 recorded for fixturepkg==9.9.9, so it is not downloaded"),
        (("--to", str(tmp_path / "missing.whl")), "no such wheel file"),
        (("--to", str(wheel_cache(proj.root) / "broken.whl")), "cannot read it as a wheel"),
        (("--to", f"fixturepkg=={V2}", "--to", f"fixturepkg=={V2}"), "--to names fixturepkg twice"),
        ((), "missing option '--to'"),
    ]:
        code, _, err = cli(proj.root, capsys, "upgrade", *args)
        assert code == 2 and message in err, (args, err)
        assert "Traceback" not in err
    code, _, err = cli(proj.root, capsys, "regen", "--all", "--from", f"fixturepkg=={V2}")
    assert code == 2 and f"is fixturepkg=={V2} but the pin is fixturepkg=={V1}" in err
    assert f"`patchgen upgrade --to fixturepkg=={V2}`" in err
    assert snapshot(proj.root) == before
    assert downloads == []  # a release without a recorded hash is refused before it is downloaded


# ---- wheels --------------------------------------------------------------------------------------------------


def test_a_cache_miss_downloads_with_pip_once_then_works_offline(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    calls: list[list[str]] = []
    real_run = subprocess.run

    def fake_pip(command, **kwargs):
        calls.append(command)
        assert command[:7] == [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--no-input",
        ]
        assert "fixturepkg==2.0.0" in command
        build_wheel(Path(command[command.index("-d") + 1]), V2, {TOY: toy_v2()})
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", fake_pip)
    target = wheels.parse_target("FixturePkg==2.0.0")
    v2 = hashlib.sha256(build_wheel(tmp_path / "v2", V2, {TOY: toy_v2()}).read_bytes()).hexdigest()
    trusted = {"fixturepkg==2.0.0": {v2}}
    wheel, downloaded = wheels.obtain(target, cache, trusted)
    assert downloaded and wheel.path == cache / "fixturepkg-2.0.0-py3-none-any.whl" and wheel.version == V2
    assert sorted(p.name for p in cache.iterdir()) == [wheel.path.name]  # the temp download dir is gone
    monkeypatch.setattr(wheels.subprocess, "run", real_run)
    monkeypatch.setattr(wheels, "download_wheel", lambda *a: pytest.fail("the cache must be used"))
    assert wheels.obtain(target, cache, trusted) == (wheel, False)
    assert len(calls) == 1


def test_failed_pip_download_is_a_user_error(tmp_path, monkeypatch) -> None:
    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for x==1\n")

    monkeypatch.setattr(wheels.subprocess, "run", failing)
    trusted = {"fixturepkg==3.0.0": frozenset({"0" * 64})}
    with pytest.raises(PatchgenError) as error:
        wheels.obtain(wheels.parse_target("fixturepkg==3.0.0"), tmp_path / "cache", trusted)
    assert str(error.value).startswith(
        "cannot download fixturepkg==3.0.0: No matching distribution found for x==1; offline? put the wheel into "
    )
    assert "\n" not in str(error.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_wheel_source_reads_the_same_text_as_an_installed_package(tmp_path) -> None:
    crlf = upstream_text(TOY).replace("\n", "\r\n")
    path = build_wheel(tmp_path, V1, {TOY: crlf}, name="renamed-on-disk.whl")
    wheel = read_wheel(path)
    assert (wheel.package, wheel.version) == ("fixturepkg", V1)  # from METADATA, not the file name
    from_wheel, installed = WheelSource([wheel]).read(TOY), FixtureSource().read(TOY)
    assert from_wheel == installed and from_wheel.sha256 == installed.sha256
    with pytest.raises(
        PatchgenError,
        match=r"upstream module 'fixturepkg\.models\.nope' not found in "
        r"fixturepkg==1\.2\.3 \(no fixturepkg/models/nope\.py in renamed-on",
    ):
        WheelSource([wheel]).read("fixturepkg.models.nope")
    with pytest.raises(PatchgenError, match="no wheel given for upstream package 'transformers'"):
        WheelSource([wheel]).version("transformers")


def test_with_pins_edits_only_the_pins() -> None:
    text = (REPO / "pyproject.toml").read_text()
    old = tomllib.loads(text)
    new_text = with_pins(text, {"transformers": "5.23.0"})
    new = tomllib.loads(new_text)
    assert new["tool"]["patchgen"]["pins"] == {**old["tool"]["patchgen"]["pins"], "transformers": "5.23.0"}
    pinned = [r for r in old["project"]["optional-dependencies"]["runtime"] if r.startswith("transformers==")]
    assert [r for r in new["project"]["optional-dependencies"]["runtime"] if r.startswith("transformers==")] == (
        ["transformers==5.23.0"] if pinned else []
    )
    changed = [(a, b) for a, b in zip(text.splitlines(), new_text.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 + len(pinned)


def test_upgrade_to_the_pinned_release_reproduces_the_checked_in_files(tmp_path, capsys, downloads) -> None:
    proj = upgrade_project(tmp_path / "proj", capsys)
    code, out, err = cli(proj.root, capsys, "upgrade", "--to", f"fixturepkg=={V1}")
    assert code == 0, err
    assert "9 of 9 patches apply in 1 model(s); `--apply` would update generated/ and the pins" in out
    review = proj.root / "upgrade-review" / f"fixturepkg-{V1}"
    assert (review / "generated/toy/modeling_toy.py").read_bytes() == (
        proj.root / "generated/toy/modeling_toy.py"
    ).read_bytes()
    assert "`generated/toy/modeling_toy.py`: unchanged.\n" in (review / "REPORT.md").read_text()
