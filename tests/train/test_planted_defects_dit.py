"""Planted DiT defects that regenerate cleanly from copies of shipped specs, and what stops each before step 1.

A split carried on the wrong argument: SD3's ``dit/carry_split`` hands the token split to the joint attention under a
key its processor does not take (``name = "dit_split"``; the processor's parameter, ``core/add_parameter``, is
``dit_sp``). Regen cannot see it (the key is a string), and diffusers' ``Attention`` drops a kwarg its processor's
signature does not name with a warning: every rank attends to its own image tokens and the text only, while every
attention module still passes its checked site (the site receives ``dit_sp=None``, as a cross-attention does). The
same mistake on the processor side (a ``carrier`` the processor has no parameter of) is refused by regen already.

Upstream's gradient-checkpointing branch not given the split: Sana's spec without its ``dit/pass_split`` patch of
``self._gradient_checkpointing_func(block, ...)``. No path of the runtime takes that branch under SP (its activation
checkpointing is its own per-block checkpoint; one process has no SP): the planted copy passes the self-check with
``parallel.activation_checkpointing``, and the branch turned on by hand is refused at the first forward under SP
(``runtime/parallel/own_checkpointing.py``). Why refuse it: a PixArt-Sigma copy without the same patch, run through
that branch under SP directly, trains wrong numbers with no error (Sana's copy stops on a reshape error instead).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from patchgen.errors import PatchgenError
from tests.dist_utils import run_distributed
from tests.train.test_planted_defects import _project, shipped

SD3_OUTPUT = "generated/planted_sd3/transformer_sd3.py"
SANA_OUTPUT = "generated/planted_sana/sana_transformer.py"
PIXART_OUTPUT = "generated/planted_pixart/pixart_transformer_2d.py"
CARRY = 'vars = { kwargs = "joint_attention_kwargs" }'
CHECKPOINT_CALL = "self._gradient_checkpointing_func(block, hidden_states"  # the anchor of that pass_split


def _misnamed_carry() -> str:
    """The shipped sd3 spec with the split carried under a key the joint attention's processor does not take."""
    spec = shipped("sd3", SD3_OUTPUT)
    assert spec.count(CARRY) == 1
    return spec.replace(CARRY, 'vars = { kwargs = "joint_attention_kwargs", name = "dit_split" }')


def _without_checkpoint_split(name: str, output: str) -> str:
    """Shipped spec ``name`` without its dit/pass_split patch of upstream's checkpointing call."""
    head, *blocks = shipped(name, output).split("[[patch]]")
    kept = [b for b in blocks if CHECKPOINT_CALL not in b]
    assert len(kept) == len(blocks) - 1
    return "[[patch]]".join([head, *kept])


def _load(path: str) -> ModuleType:
    """The generated module at ``path`` with its companions: its folder becomes the ``generated`` subpackage its
    imports name (each test's folder name is its own; the workers are fresh processes)."""
    folder = Path(path).parent
    package = f"generated.{folder.name}"
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{Path(path).stem}")


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    misnamed = _project(tmp_path_factory.mktemp("misnamed"), _misnamed_carry(), name="sd3", output=SD3_OUTPUT)
    sana_spec = _without_checkpoint_split("sana", SANA_OUTPUT)
    sana = _project(tmp_path_factory.mktemp("sana"), sana_spec, name="sana", output=SANA_OUTPUT)
    pixart_spec = _without_checkpoint_split("pixart_sigma", PIXART_OUTPUT)
    pixart = _project(tmp_path_factory.mktemp("pixart"), pixart_spec, name="pixart_sigma", output=PIXART_OUTPUT)
    assert 'key="dit_split"' in misnamed.read_text()
    assert "with_split(dit_sp, self._gradient_checkpointing_func)" not in sana.read_text()
    assert "with_split(dit_sp, block)" in sana.read_text()  # the blocks' plain call still takes the split
    assert "with_split(dit_sp, self._gradient_checkpointing_func)" not in pixart.read_text()
    return {"misnamed carry": misnamed, "sana": sana, "pixart": pixart}


def test_a_carrier_the_processor_does_not_take_is_refused_by_regen(tmp_path: Path) -> None:
    """The processor-side twin of the misnamed carry: regen's name check sees it, so it never reaches a run."""
    spec = shipped("sd3", SD3_OUTPUT).replace('carrier = "dit_sp"', 'carrier = "dit_split"')
    with pytest.raises(PatchgenError) as caught:
        _project(tmp_path, spec, name="sd3", output=SD3_OUTPUT)
    assert "vars.carrier = 'dit_split' names nothing" in str(caught.value), caught.value


CASES = {  # name: (planted copy, its class, the runtime's activation checkpointing, upstream's own branch on)
    "misnamed carry": ("misnamed carry", "SD3Transformer2DModelForTraining", False, False),
    "sana, runtime checkpointing": ("sana", "SanaTransformer2DModelForTraining", True, False),
    "sana, upstream's branch on": ("sana", "SanaTransformer2DModelForTraining", False, True),
}


def check_worker(rank: int, world_size: int, cases: dict[str, tuple], pixart_path: str) -> dict[str, tuple]:
    """The DiT self-check at sp = world size of each case (name: the generated module's path, the class, the
    runtime's activation checkpointing, upstream's own checkpointing branch turned on): name -> (the start-up line,
    or the error); and "branch gap": upstream's branch run directly under SP by the PixArt copy at ``pixart_path``
    and by the shipped PixArt (``_branch_gap``)."""
    from runtime.config.errors import ConfigError
    from runtime.diffusion.registry import lookup_dit, training_class
    from runtime.parallel.parallelize import ParallelPlan
    from runtime.parallel.state import init_parallel_state, set_parallel_state
    from runtime.train.job import site_plan
    from runtime.train.self_check import run_proof
    from runtime.train.self_check_dit import prove_dit

    state = init_parallel_state(sp_size=world_size)
    results = {}
    for name, (path, cls, checkpointing, own) in cases.items():
        shell = getattr(_load(path), cls)
        model_type = shell.config_class.model_type

        class OwnCheckpointing(shell):
            """As a user's code would: upstream's own checkpointing branch turned on."""

            def __init__(self, config) -> None:
                super().__init__(config)
                self.gradient_checkpointing_enable()

        plan = ParallelPlan(**site_plan(model_type), activation_checkpointing=checkpointing)
        job = shell.config_class(**lookup_dit(model_type).tiny)
        model_class = OwnCheckpointing if own else shell
        lines: list[str] = []
        try:
            prove = functools.partial(prove_dit, model_type, plan, state, job, model_class)
            run_proof(prove, "train.self_check", lines.append, state.loss_group)
            results[name] = (lines[0], "")
        except ConfigError as exc:
            results[name] = ("", str(exc))
    pixart = _load(pixart_path).PixArtTransformer2DModelForTraining
    results["branch gap"] = (_branch_gap(pixart, state), _branch_gap(training_class("pixart_sigma"), state))
    set_parallel_state(None)
    return results


def _branch_gap(shell: type, state: object) -> float:
    """The worst error (the self-check's ``compare``) of PixArt-Sigma's tiny case run through upstream's own
    checkpointing branch under SP (no ``parallelize``: nothing refuses it; partial gradients summed over the group)
    against one process."""
    import torch
    import torch.distributed as dist

    from runtime.parallel.state import ParallelState, parallel_state
    from runtime.train.self_check import compare, tolerance
    from tests.dit.cases import CASES, inputs, loss_and_grads

    case = CASES["pixart_sigma"]

    def run() -> tuple:
        torch.manual_seed(0)
        model = shell(shell.config_class(**case.config))
        model.gradient_checkpointing_enable()
        model.train()
        _, loss, grads = loss_and_grads(model, inputs(case))
        return loss, {name: grad for name, grad in grads.items() if grad is not None}

    with parallel_state(ParallelState()):
        reference = run()
    loss, grads = run()
    for grad in grads.values():
        dist.all_reduce(grad, group=state.sp_group)
    comparison = compare("upstream's branch under SP", loss, grads, *reference, tolerance(torch.float32))
    return max(comparison.loss_error, *comparison.errors.values())


@pytest.fixture(scope="module")
def checked(planted: dict[str, Path]) -> list[dict[str, tuple[str, str]]]:
    """Every rank's results of every case (one group of processes for all)."""
    cases = {name: (str(planted[copy]), *rest) for name, (copy, *rest) in CASES.items()}
    return run_distributed(check_worker, 2, cases, str(planted["pixart"]), timeout=300)


@pytest.mark.dist
def test_a_split_carried_under_the_wrong_key_is_caught(checked: list) -> None:
    """The misnamed carry regenerates cleanly and passes every site; the self-check's numbers stop it at sp = 2."""
    results = [ranks["misnamed carry"] for ranks in checked]
    for line, error in results:
        assert error == results[0][1] and "\n" not in error and not line, results
    error = results[0][1]
    assert error.startswith("train.self_check: the start-up self-check failed: ") and "sp 2" in error, error


def test_a_dit_job_with_the_self_check_off_needs_a_reason() -> None:
    """The same job with ``train.self_check: false`` and no reason is refused when its config is read, one line."""
    from runtime.config.errors import ConfigError
    from runtime.train.config import parse_config

    raw = {"model": {"type": "sd3", "path": "pipelines/sd3"}, "data": {"path": "images.jsonl", "buckets": [[32, 32]]}}
    with pytest.raises(ConfigError) as caught:
        parse_config({**raw, "train": {"self_check": False}})
    (message,) = caught.value.messages
    assert message.startswith("train.self_check: false needs a reason: write `self_check: {enabled: false"), message
    assert "\n" not in message
    stated = parse_config({**raw, "train": {"self_check": {"enabled": False, "reason": "a bench"}}}).train.self_check
    assert not stated.enabled and stated.reason == "a bench"


@pytest.mark.dist
def test_sana_without_the_checkpointing_split_passes_under_the_runtimes_checkpointing(checked: list) -> None:
    """The runtime's activation checkpointing never takes upstream's branch: the planted copy is proven at sp = 2."""
    line, error = checked[0]["sana, runtime checkpointing"]
    assert error == "" and line.startswith("self-check: passed in "), line
    assert "sp 2, float32 (train.mixed_precision auto), activation checkpointing vs one process" in line, line


@pytest.mark.dist
def test_upstreams_checkpointing_branch_under_sp_is_refused(checked: list) -> None:
    """Turned on by hand, upstream's branch (here without the split) is refused at the first forward under SP."""
    results = [ranks["sana, upstream's branch on"] for ranks in checked]
    for line, error in results:
        assert error == results[0][1] and "\n" not in error and not line, results
    assert results[0][1].startswith(
        "OwnCheckpointing.gradient_checkpointing is on under parallel.sp = 2: upstream's "
        "checkpointing branch calls the blocks with upstream's arguments"
    ), results[0][1]
    assert "parallel.activation_checkpointing: true" in results[0][1]


@pytest.mark.dist
def test_the_branch_without_the_split_trains_wrong_numbers(checked: list) -> None:
    """Why the refusal: a PixArt-Sigma copy without the same patch, run directly under SP through upstream's branch
    (as tests/dit/test_sp.py runs the shipped specs), trains wrong numbers with no error: its blocks get no split,
    each rank attends to its own tokens (every site passed). The shipped spec's stays inside the self-check's
    tolerance. (Sana's copy does not get that far: its feed-forward's grid, built from the whole image's rows, does
    not fit the rank's tokens, a reshape error; the refusal turns either into one line.)"""
    import torch

    from runtime.train.self_check import tolerance

    planted, shipped_gap = checked[0]["branch gap"]
    assert planted > 100 * tolerance(torch.float32) and shipped_gap < tolerance(torch.float32), (planted, shipped_gap)
