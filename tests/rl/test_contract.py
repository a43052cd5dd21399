"""The loop and an algorithm meet only through ``runtime/rl/algorithms/base.py``: every algorithm of the registry is
an ``Algorithm`` with consistent declarations, and no module of the job probes an algorithm for optional names
(``getattr``/``hasattr`` on it), so a misspelt hook cannot silently fall back to Flow-GRPO's behaviour."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from runtime.rl.algorithms.base import Algorithm
from runtime.rl.config import ALGORITHMS, algorithm

RL = Path(__file__).resolve().parents[2] / "runtime" / "rl"


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_implements_the_contract(name: str) -> None:
    algo = algorithm(name)
    assert isinstance(algo, Algorithm) and algo.name == name
    assert dataclasses.is_dataclass(algo.Settings) and algo.Settings.__dataclass_params__.frozen
    assert algo.data in ("prompts", "pairs") and algo.trains_on in ("steps", "clean_samples", "pairs")
    assert (algo.data == "pairs") == (algo.trains_on == "pairs")
    overridden = {
        "steps": "step_objective",
        "clean_samples": "forward_objective",
        "pairs": "pair_objective",
    }[algo.trains_on]
    assert getattr(type(algo), overridden) is not getattr(Algorithm, overridden), (name, overridden)
    settings = algo.Settings()
    assert isinstance(algo.conventions(settings), str) and algo.state_dict() == {}
    if algo.data == "prompts":
        size, (lo, hi) = algo.window(settings, 6, 1)
        assert 1 <= size <= 6 and 0 <= lo <= hi


def test_no_module_of_the_job_probes_an_algorithm() -> None:
    probes = []
    for path in sorted(RL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "algo" in target:
                    probes.append(f"{path.relative_to(RL)}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes
