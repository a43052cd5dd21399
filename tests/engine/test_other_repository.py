"""patchgen in another repository (issue 11, G), as docs/other-repositories.md tells it: a project with its own
pyproject table, directories, templates and spec, driven from the command line in its own directory; and the
pre-commit hook this repository publishes (.pre-commit-hooks.yaml), run the way pre-commit runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from patchgen.wheels import wheel_cache
from tests.engine.helpers import FIXTURES, REPO, VERSION, build_wheel, fixture_wheel_sha256

PATCHGEN = Path(sys.executable).parent / "patchgen"
FROM = ("--from", f"fixturepkg=={VERSION}")
OUTPUT = "src/mypkg/generated/toy/modeling_toy.py"

PYPROJECT = f"""\
[project]
name = "mypkg"
version = "1.0"

[tool.patchgen]
specs = "patching/specs"
templates = "patching/templates"
generated = "src/mypkg/generated"
pins = {{ fixturepkg = "{VERSION}" }}

[tool.patchgen.wheel_sha256]
"fixturepkg=={VERSION}" = "{fixture_wheel_sha256()}"
"""

WEIGHTED = """\
{#
op = "wrap"
doc = "Scale a loss by a constant weight."

[vars.weight]
kind = "float"
doc = "the factor"
#}
{{ weight }} * {{ expr }}
"""

DESCRIBE = """\
{#
op = "add_method"
doc = "A method naming the model, for logs."

[vars.label]
kind = "str"
doc = "what describe() returns"
#}
def describe(self):
    return {{ label }}
"""

SPEC = f"""\
module = "fixturepkg.models.modeling_toy"
output = "{OUTPUT}"
keep = ["ToyForTask"]

[[patch]]
template = "team/weighted"
scope = "ToyForTask.forward"
anchor = "self.loss_function(out, labels)"
vars = {{ weight = 0.5 }}
why = "the toy loss counts half"

[[patch]]
template = "team/describe"
scope = "ToyForTask"
vars = {{ label = "toy, weighted" }}
why = "logs name the variant"
"""

USE = textwrap.dedent("""
    from fixturepkg.models.modeling_toy import ToyConfig, ToyForTask as Upstream
    from mypkg.generated.toy.modeling_toy import ToyForTask
    hidden, labels = [0.3, -1.2, 2.0], [0.0, 1.0, -1.0]
    _, ours = ToyForTask(ToyConfig()).forward(hidden, labels=labels)
    _, theirs = Upstream(ToyConfig()).forward(hidden, labels=labels)
    assert ours == 0.5 * theirs and theirs > 0, (ours, theirs)
    print(ToyForTask(ToyConfig()).describe())
""")


def run(root: Path, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120, env=env)


def other_repository(root: Path) -> Path:
    (root / "patching" / "specs").mkdir(parents=True)
    (root / "patching" / "templates" / "team").mkdir(parents=True)
    (root / "src" / "mypkg").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "patching" / "templates" / "team" / "weighted.py.j2").write_text(WEIGHTED)
    (root / "patching" / "templates" / "team" / "describe.py.j2").write_text(DESCRIBE)
    (root / "patching" / "specs" / "toy.toml").write_text(SPEC)
    (root / "src" / "mypkg" / "__init__.py").write_text("# the team's own package\n")
    build_wheel(wheel_cache(root), VERSION)  # as `pip download` would leave it; checked against wheel_sha256
    return root


def test_a_project_with_its_own_specs_templates_and_the_published_pre_commit_hook(tmp_path) -> None:
    root = other_repository(tmp_path / "elsewhere")
    done = run(root, str(PATCHGEN), "regen", "--all", *FROM)
    assert done.returncode == 0, done.stderr
    generated = sorted(p.relative_to(root).as_posix() for p in (root / "src").rglob("*") if p.is_file())
    assert generated == [
        "src/mypkg/__init__.py",
        "src/mypkg/generated/__init__.py",
        "src/mypkg/generated/toy/__init__.py",
        "src/mypkg/generated/toy/modeling_toy.py",
        "src/mypkg/generated/toy/modeling_toy.py.diff",
    ]
    assert (root / "src" / "mypkg" / "__init__.py").read_text() == "# the team's own package\n"  # not patchgen's
    text = (root / OUTPUT).read_text()
    assert "# patchgen #1 team/weighted (1 stmt): the toy loss counts half\n" in text
    assert "loss = 0.5 * self.loss_function(out, labels)" in text
    done = run(root, str(PATCHGEN), "list")
    assert done.stdout.startswith("toy              fixturepkg.models.modeling_toy") and "(2 patches)" in done.stdout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(FIXTURES / "upstream")])}
    done = run(root, sys.executable, "-c", USE, env=env)
    assert done.returncode == 0 and done.stdout == "toy, weighted\n", done.stderr

    # CI's gate proves every body from its inputs; the hook is the fast check, run as pre-commit runs it
    done = run(root, str(PATCHGEN), "check", "--full", *FROM)
    assert done.returncode == 0 and "ok: 1 spec(s) match src/mypkg/generated/" in done.stdout, done.stderr
    [hook] = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "patchgen-check" and hook["language"] == "python" and hook["pass_filenames"] is False
    entry = [str(PATCHGEN), *hook["entry"].split()[1:], *FROM]  # pre-commit runs `entry` + the user's `args`
    done = run(root, *entry)
    assert done.returncode == 0 and "ok: 1 spec(s) match src/mypkg/generated/" in done.stdout, done.stderr
    target = root / OUTPUT
    target.write_text(target.read_text().replace("0.5 * self.loss_function", "0.25 * self.loss_function"))
    done = run(root, *entry)
    assert done.returncode == 1 and f"DRIFT {OUTPUT}: edited by hand" in done.stderr
