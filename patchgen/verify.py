"""`patchgen upgrade --verify`: prove the models regenerated on a new release at parity, without touching the project.

A scratch tree (a copy of specs/, templates/, patchgen/, runtime/, tests/, generated/ and pyproject.toml) holds the
specs being verified and their ancestors only, so the spec-driven suites parametrize over exactly those models. It is
regenerated from the release's wheel and tested by a scratch virtual environment (`patchgen.scratch_env`): its own
site-packages hold the target wheel and those of its unmet requirements whose wheel sha256 the project records, and a
.pth line layers the project venv's site-packages under them (a plain path: the project's editable install is not
loaded, so `patchgen`, `runtime` and `generated` are imported from the scratch tree). One pytest run writes a JUnit
file; each test is given to the model(s) its name mentions, and a test that names no model to every verified model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from patchgen.config import ProjectConfig, load_config, with_pins
from patchgen.errors import PatchgenError
from patchgen.ownership import outputs, owned_paths
from patchgen.scratch_env import make_env
from patchgen.spec import Spec
from patchgen.spec_set import load_specs
from patchgen.upgrade import Upgrade, analyze
from patchgen.upstream import UpstreamSource, Wheel, normalize_name
from patchgen.verify_edits import check_spec_edits

COPIED = ("pyproject.toml", "specs", "templates", "patchgen", "runtime", "tests", "generated")
SUITES = {  # the spec-driven parity suites of each upstream package's models
    "transformers": ("tests/parity", "tests/fidelity", "tests/models"),
    "diffusers": ("tests/dit",),
}
PROVEN, FAILING, NOT_REGENERATED, NO_TEST = "proven", "regenerated but failing", "not regenerated", "no test ran"
BAD = ("failed", "error")


@dataclass(frozen=True)
class Outcome:
    """One test's result: `test` is `path::name[params]`; outcome passed, failed, error or skipped."""

    test: str
    outcome: str
    message: str = ""  # a failure's `E ` lines (e.g. `KeyError: 'wan'`), joined by " | "


@dataclass(frozen=True)
class Proof:
    model: str
    status: str  # PROVEN, FAILING, NOT_REGENERATED or NO_TEST
    failing: tuple[str, ...] = ()  # the failing tests' ids
    passed: int = 0  # tests of this model (its own and the shared ones) that passed

    @property
    def label(self) -> str:
        if self.status != FAILING:
            return self.status
        more = f", {len(self.failing) - 1} more" if len(self.failing) > 1 else ""
        return f"{FAILING} ({self.failing[0]}{more})"


@dataclass(frozen=True)
class Verification:
    proofs: tuple[Proof, ...]
    installed: tuple[str, ...]  # what the scratch venv installed over the project venv (pins)
    unmet: tuple[str, ...]  # requirements still unmet there, one line each
    suites: tuple[str, ...]
    counts: dict[str, int]  # outcome -> number of tests
    upgrade: Upgrade  # the scratch tree's analysis (migrated specs when --migrate gave edits)
    ignored: tuple[Outcome, ...] = ()  # tests about models outside the verification only: not counted
    pytest_problem: str = ""  # pytest did not report (crash, timeout): every regenerated model fails with it

    @property
    def proven(self) -> bool:
        return bool(self.proofs) and all(p.status == PROVEN for p in self.proofs)


# ---- classification (pure) ------------------------------------------------------------------------------------


def mentioned(test: str, names: dict[str, str]) -> set[str]:
    """The models a test's name (after `::`) mentions: `names` maps a spec name or model_type to its spec. A name
    counts only as a whole `_`/`-`/`[`-delimited run (`qwen3` is not found inside `qwen3_moe`): longest first."""
    text = test.split("::", 1)[-1].lower()
    found, taken = set(), [False] * len(text)
    for name in sorted(names, key=len, reverse=True):
        for match in re.finditer(rf"(?<![a-z0-9]){re.escape(name.lower())}(?![a-z0-9])", text):
            if not any(taken[match.start() : match.end()]):
                taken[match.start() : match.end()] = [True] * (match.end() - match.start())
                found.add(names[name])
    return found


_ABSENT = (  # how a suite that looks a model up by name fails when that model is not in the scratch tree
    r"KeyError: '([\w.-]+)'",
    r"model_type '([\w.-]+)'",
    r"assert '([\w.-]+)' in ",
    r"No such file or directory: '[^']*/specs/([\w.-]+)\.toml'",
)


def absent(message: str, names: dict[str, str]) -> set[str]:
    """The models a failure message shows missing (`KeyError: 'wan'`, `model_type 'qwen3'`, ...)."""
    return {names[n] for pattern in _ABSENT for n in re.findall(pattern, message) if n in names}


def attribute(outcome: Outcome, names: dict[str, str]) -> set[str]:
    """The models a test is about: those its name mentions; for a failure naming none, those it shows missing."""
    found = mentioned(outcome.test, names)
    return found or (absent(outcome.message, names) if outcome.outcome in BAD else set())


def classify(
    regenerated: list[str],
    not_regenerated: list[str],
    outcomes: list[Outcome],
    names: dict[str, str],
    problem: str = "",
) -> tuple[list[Proof], list[Outcome]]:
    """Per model: proven when its tests and the shared ones (naming no model) ran and none failed, at least one of
    its own passed. Returns the proofs and the tests not counted (about models outside the verification only).
    `problem`: pytest gave no results, nobody is proven."""
    own: dict[str, list[Outcome]] = {m: [] for m in regenerated}
    shared: list[Outcome] = []
    ignored: list[Outcome] = []
    for one in outcomes:
        models = attribute(one, names)
        if not models:
            shared.append(one)
        elif not models & own.keys():
            ignored.append(one)
        for model in models & own.keys():
            own[model].append(one)
    proofs = []
    for model in sorted(regenerated):
        tests = own[model] + shared
        failing = tuple(o.test for o in tests if o.outcome in BAD) or ((f"pytest: {problem}",) if problem else ())
        passed = sum(o.outcome == "passed" for o in own[model])
        status = FAILING if failing else PROVEN if passed else NO_TEST
        proofs.append(Proof(model, status, failing, passed + sum(o.outcome == "passed" for o in shared)))
    proofs += [Proof(m, NOT_REGENERATED) for m in not_regenerated]
    return sorted(proofs, key=lambda p: p.model), ignored


def read_junit(path: Path) -> list[Outcome]:
    """Outcomes from pytest's JUnit XML (classname `tests.parity.test_x` -> `tests/parity/test_x.py::name`)."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name', '')}" if module else case.get("name", "")
        bad = next((child for child in case if child.tag in ("failure", "error")), None)
        if bad is None:
            out.append(Outcome(test, "skipped" if case.find("skipped") is not None else "passed"))
            continue
        lines = [line[1:].strip() for line in (bad.text or "").splitlines() if line.startswith("E ")]
        message = " | ".join(lines)[:4000] if lines else bad.get("message", "")
        out.append(Outcome(test, "failed" if bad.tag == "failure" else "error", message))
    return out


# ---- the scratch environment ----------------------------------------------------------------------------------


# ---- the scratch tree ------------------------------------------------------------------------------------------


def scratch_tree(
    root: Path, dest: Path, models: list[str], packages: set[str], spec_edits: dict[str, str] | None = None
) -> list[str]:
    """Copy the project into `dest`; of the specs of the upgraded `packages` keep only `models` and those they
    extend (with their generated files); other packages' specs stay as they are (their pins do not move).
    `spec_edits` (spec path relative to the root -> text, e.g. a migration's) are written there. Returns the specs
    kept."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = root / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))
    for relpath, text in (spec_edits or {}).items():
        (dest / relpath).write_text(text, encoding="utf-8")
    config = load_config(dest)
    specs = load_specs(config, None)
    wanted = {s.name for s in specs if s.name in models}
    kept = wanted | {p.stem for s in specs if s.name in wanted for p in s.extends}
    kept |= {s.name for s in specs if normalize_name(s.package) not in packages}
    for spec in specs:
        if spec.name not in kept:
            _remove(config, spec)
    return sorted(kept)


def _remove(config: ProjectConfig, spec: Spec) -> None:
    """A spec and its generated module, diff and record (package `__init__.py` files stay: others share them)."""
    for i, output in enumerate(spec.outputs):
        for path in owned_paths(config, output, record=i == 0):
            if path.name != "__init__.py":
                path.unlink(missing_ok=True)
    spec.path.unlink()


def regenerate(dest: Path, wheels: list[Wheel], baseline: UpstreamSource, models: list[str]) -> tuple[Upgrade, list]:
    """Analyze the scratch tree's specs against the wheels and write the models whose every patch applies (with
    the new pins); a model that does not fully regenerate loses its spec and files (its tests do not run)."""
    config = load_config(dest)
    result = analyze(config, load_specs(config, None), wheels, baseline)
    pyproject = dest / "pyproject.toml"
    keys = {normalize_name(k): k for k in config.pins}
    pyproject.write_text(with_pins(pyproject.read_text(), {keys[w.package]: w.version for w in wheels}))
    done, failed = [], []
    for model in result.models:
        if model.spec.name not in models:
            continue
        if model.ok:
            for path, text in outputs(config, model.generated).items():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8", newline="")
            done.append(model)
        else:
            failed.append(model.spec.name)
            _remove(config, model.spec)
    return result, [done, failed]


def run_suites(python: Path, dest: Path, suites: list[str], timeout: float) -> tuple[list[Outcome], str]:
    """One pytest run of the suites in the scratch tree; (outcomes, problem) where problem says why none came."""
    junit = dest / "junit.xml"
    command = [str(python), "-m", "pytest", *suites, "-p", "no:cacheprovider", "-q", "-o", "addopts="]
    command += ["--continue-on-collection-errors"]
    command += [f"--junitxml={junit}"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    try:
        result = subprocess.run(command, cwd=dest, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout:.0f} s"
    if not junit.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [f"exit {result.returncode}"]
        return [], tail[0][:200]
    outcomes = read_junit(junit)
    return outcomes, "" if outcomes or result.returncode == 0 else f"exit {result.returncode}, no test ran"


def verify(
    root: Path,
    wheels: list[Wheel],
    baseline: UpstreamSource,
    cache: Path,
    models: list[str] | None = None,
    spec_edits: dict[str, str] | None = None,
    timeout: float = 5400,
) -> Verification:
    """Regenerate `models` (default: every spec of the upgraded packages) against the wheels in a scratch tree and
    run their parity suites there; nothing under `root` changes."""
    packages = {w.package for w in wheels}
    config = load_config(root)
    check_spec_edits(config, spec_edits or {})  # what runs before review may come from migration's edits only
    specs = load_specs(config, None)
    every = [s.name for s in specs if normalize_name(s.package) in packages]
    unknown = sorted(set(models or []) - set(every))
    if unknown:
        raise PatchgenError(f"--verify-model {', '.join(unknown)}: not a spec of {', '.join(sorted(packages))}")
    models = sorted(models or every)
    with tempfile.TemporaryDirectory(prefix="patchgen-verify-") as tmp:
        dest = Path(tmp) / "tree"
        dest.mkdir()
        scratch_tree(root, dest, models, packages, spec_edits)
        result, (done, failed) = regenerate(dest, wheels, baseline, models)
        python, installed, unmet = make_env(Path(tmp) / "venv", wheels, cache, config.wheel_sha256)
        suites = sorted({s for p in packages for s in SUITES.get(p, ()) if (dest / s).is_dir()})
        outcomes, problem = run_suites(python, dest, suites, timeout) if done else ([], "")
    names = {}
    for spec in specs:  # every model of the project: a test about one left out is not counted
        names[spec.name] = spec.name
        if spec.model is not None:
            names[spec.model.model_type] = spec.name
    proofs, ignored = classify([m.spec.name for m in done], failed, outcomes, names, problem)
    counts = {k: sum(o.outcome == k for o in outcomes) for k in ("passed", "failed", "error", "skipped")}
    mine = dataclasses.replace(result, models=tuple(m for m in result.models if m.spec.name in models))
    return Verification(
        tuple(proofs), tuple(installed), tuple(unmet), tuple(suites), counts, mine, tuple(ignored), problem
    )


# ---- reporting -------------------------------------------------------------------------------------------------


def applying(verification: Verification) -> dict[str, str]:
    """Model -> `k of n` patches applying in the scratch tree (migrated specs when edits were given)."""
    return {
        m.spec.name: f"{sum(s.applies for s in m.patches)} of {len(m.patches)}" + (" (problem)" if m.problem else "")
        for m in verification.upgrade.models
    }


def markdown(verification: Verification, command: str) -> str:
    """The report's proof section: one row per model with its proof column (deterministic: no times, no paths)."""
    v = verification
    counts = ", ".join(f"{n} {k}" for k, n in v.counts.items() if n) or "no test ran"
    proven = sum(p.status == PROVEN for p in v.proofs)
    out = [
        "## Proof (`--verify`)",
        "",
        f"**{proven} of {len(v.proofs)} model(s) proven at parity on {', '.join(w.pin for w in v.upgrade.wheels)}.** "
        f"Made by `{command}`: each model whose every patch applies was regenerated in a scratch copy of the project "
        f"and `pytest {' '.join(v.suites)}` ran there in a scratch venv holding {', '.join(v.installed)} over the "
        f"project venv ({counts}). `proven`: its parity tests (parallelism off bitwise against the new upstream "
        "with every gradient, SP=2 within the rounding model, save/load) and the suites' shared tests passed; nothing "
        "in the project's generated/ or venv changed.",
        "",
    ]
    if v.unmet:
        out += ["Requirements the scratch venv still does not meet:", "", *[f"- {line}" for line in v.unmet], ""]
    out += ["| model | patches applying | proof | tests passed |", "|---|---|---|---|"]
    rows = applying(v)
    for p in v.proofs:
        failing = "; ".join(f"`{t}`" for t in p.failing)
        label = p.status + (f" ({failing})" if failing else "")
        out.append(f"| {p.model} | {rows.get(p.model, '-')} | {label.replace('|', chr(92) + '|')} | {p.passed} |")
    if v.ignored:
        out += [
            "",
            "Not counted (they look up a model outside this verification by name, which the scratch tree "
            "does not hold):",
            "",
            *[f"- `{o.test}`" for o in v.ignored],
        ]
    return "\n".join(out) + "\n"


def console(verification: Verification) -> str:
    rows = applying(verification)
    width = max((len(p.model) for p in verification.proofs), default=5)
    lines = [f"{p.model:<{width}}  {rows.get(p.model, '-'):<8}  {p.label}" for p in verification.proofs]
    extra = [f"still unmet in the scratch venv: {u}" for u in verification.unmet]
    return "\n".join(["proof (--verify):", *lines, *extra])
