"""The tiny configs reach every config-gated branch of every patched scope, both ways.

A patch over code that branches on the config is only tested where the tiny config takes the branch: a loss patch
that deleted gemma2's final-logit softcap passed every suite because the tiny config left the softcap at its
default. So for each spec, each ``if`` / conditional expression / ``while`` test in a patched scope that reads the
model's config (``self.config.*``, or an attribute ``__init__`` set from the config) is evaluated on the upstream
module built (on the meta device) from the spec's tiny config and from each of its ``[model.data.tiny_variants]``:
over those configs the test must come out both true and false. The parity suites run every variant
(tests/parity/test_dense_off.py, tests/dit/cases.py), so a branch a variant reaches is compared with upstream.
A branch no training run can take is listed, by its config name, in the spec's ``[model.data] untested_branches``
(with a comment saying why).
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.models.registry import REGISTRY, GeneratedModel

ROOT = Path(__file__).resolve().parents[2]


@cache
def _upstream_tree(module: str) -> ast.Module:
    return ast.parse(Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8"))


def _config_attrs(init: ast.FunctionDef | None) -> dict[str, set[str]]:
    """``self.<attr>`` assigned in ``__init__`` from the config (or from an ``__init__`` argument, which is a config
    key for diffusers models) -> the config names it reads."""
    if init is None:
        return {}
    params = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self", "config"}
    found: dict[str, set[str]] = {}
    for node in ast.walk(init):
        if not isinstance(node, ast.Assign):
            continue
        names = _config_names(node.value, params)
        for target in node.targets:
            if names and isinstance(target, ast.Attribute) and _is_self(target.value):
                found.setdefault(target.attr, set()).update(names)
    return found


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _config_names(expr: ast.AST, params: set[str]) -> set[str]:
    names = set()
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "config":
            names.add(sub.attr)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "config":
            names.add(sub.attr)
        elif isinstance(sub, ast.Name) and sub.id in params:
            names.add(sub.id)
    return names


def _gated_tests(entry: GeneratedModel) -> list[tuple[str, ast.expr, set[str]]]:
    """(scope, test expression, config names) of every config-gated test in the spec's patched scopes that reads
    only ``self`` (so it can be evaluated on a built module)."""
    spec = tomllib.loads((ROOT / "specs" / f"{entry.spec}.toml").read_text(encoding="utf-8"))
    classes = {n.name: n for n in _upstream_tree(spec["module"]).body if isinstance(n, ast.ClassDef)}
    found = []
    for scope in sorted({p["scope"] for p in spec.get("patch", []) if ":" not in p["scope"]}):
        cls_name, _, method = scope.partition(".")
        cls = classes.get(cls_name)
        methods = {f.name: f for f in getattr(cls, "body", []) if isinstance(f, ast.FunctionDef)}
        if method not in methods:
            continue
        attrs = _config_attrs(methods.get("__init__"))
        for node in ast.walk(methods[method]):
            if not isinstance(node, ast.If | ast.IfExp | ast.While):
                continue
            free = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if free - {"self", "None", "True", "False", "len", "any", "all"}:
                continue  # reads the forward's inputs too: not a property of the config alone
            names = _config_names(node.test, set())
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Attribute) and _is_self(sub.value) and sub.attr in attrs:
                    names |= attrs[sub.attr]
            if names:
                found.append((scope, node.test, names))
    return found


def _configs(entry: GeneratedModel) -> dict[str, dict[str, Any]]:
    """The variants' overrides by name, the tiny config itself as ``{}``."""
    return {"tiny": {}, **entry.data.get("tiny_variants", {})}


def _build(entry: GeneratedModel, overrides: dict[str, Any]) -> torch.nn.Module:
    from runtime.models.tiny_configs import tiny_config

    cls = entry.upstream_class()
    with torch.device("meta"):
        if entry.family == "dit":
            return cls(**{**entry.tiny, **overrides})
        return cls.from_config(tiny_config(entry.model_type, **overrides))


def _outcomes(entry: GeneratedModel) -> dict[tuple[str, str], tuple[set[bool], set[str]]]:
    tests = _gated_tests(entry)
    outcomes: dict[tuple[str, str], tuple[set[bool], set[str]]] = {}
    for values in _configs(entry).values():
        model = _build(entry, values)
        for scope, test, names in tests:
            cls_name = scope.partition(".")[0]
            code = compile(ast.Expression(test), "<test>", "eval")
            seen, _ = outcomes.setdefault((scope, ast.unparse(test)), (set(), names))
            for module in (m for m in model.modules() if type(m).__name__ == cls_name):
                seen.add(bool(eval(code, {"len": len, "any": any, "all": all}, {"self": module})))  # noqa: S307
    return outcomes


CASES = sorted(REGISTRY)


@pytest.mark.parametrize("model_type", CASES)
def test_every_config_gated_branch_of_a_patched_scope_is_reached_both_ways(model_type: str) -> None:
    entry = REGISTRY[model_type]
    untested = set(entry.data.get("untested_branches", []))
    missing = []
    for (scope, test), (seen, names) in sorted(_outcomes(entry).items()):
        if seen and seen != {True, False} and not names & untested:
            way = "false" if True in seen else "true"
            missing.append(
                f"specs/{entry.spec}.toml: `{test}` in {scope} (config {sorted(names)}) is never {way} in the tiny "
                f"config or its variants; add a [model.data.tiny_variants.<name>] that makes it {way}, or list the "
                f"name in [model.data] untested_branches with a comment saying why no run takes that branch"
            )
    assert not missing, "\n".join(missing)
