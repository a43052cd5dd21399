"""A wrongly stated SP layout raises at the first SP forward, naming the spec and the var, instead of computing a
wrong result; an attention module the spec did not declare (HunyuanVideo's text refiner keeps upstream's processor)
is refused naming the module and the var to set.

Each case generates HunyuanVideo (which joins ``[video, text]``) from a variant of its real spec in a scratch
project, imports the patched diffusers class from there and runs it at SP=2 (gloo).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.dit.cases import CASES, inputs

ROOT = Path(__file__).resolve().parents[2]


def _variant(tmp: Path, name: str, edit: tuple[str, str]) -> Path:
    """Generate specs/hunyuanvideo.toml with one edit (its [model] table and shell dropped: a scratch module)."""
    project = tmp / name
    (project / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    shutil.copytree(ROOT / "templates", project / "templates")
    text = (ROOT / "specs" / "hunyuanvideo.toml").read_text()
    assert edit[0] in text
    text = text.replace(*edit)
    head, _, rest = text.partition("\n[model]\n")
    patches = rest[rest.index("[[patch]]") :].split("[[patch]]")
    kept = [p for p in patches if p.strip() and "dit/training_shell" not in p]
    (project / "specs" / "hunyuanvideo.toml").write_text(head + "\n" + "".join("[[patch]]" + p for p in kept))
    done = subprocess.run(
        [sys.executable, "-m", "patchgen.cli", "regen", "hunyuanvideo", "--root", str(project)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    output = next(line for line in text.splitlines() if line.startswith("output = "))
    return project / output.split('"')[1]


def _forward_error(rank: int, world_size: int, module_path: str) -> str:
    import torch

    from runtime.parallel.state import init_parallel_state

    spec = importlib.util.spec_from_file_location(f"scratch_hunyuan_{abs(hash(module_path))}", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    init_parallel_state(sp_size=world_size)
    case = CASES["hunyuanvideo"]
    torch.manual_seed(0)
    model = module.HunyuanVideoTransformer3DModel(**case.config)
    try:
        model(**inputs(case))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_a_wrongly_stated_layout_raises_at_the_first_forward(tmp_path: Path) -> None:
    wrong = _variant(tmp_path, "first", ('replicated = "last"', 'replicated = "first"'))
    messages = run_distributed(_forward_error, 2, str(wrong), timeout=300)
    for message in messages:
        assert message.startswith("specs/hunyuanvideo.toml patch 4 (dit/ulysses_to_heads"), message
        assert "replicated = 'first'" in message and "fix the var `replicated`" in message, message


@pytest.mark.dist
def test_an_undeclared_replicated_module_is_refused_naming_the_var(tmp_path: Path) -> None:
    missing = _variant(tmp_path, "norefiner", (', replicated_modules = ["context_embedder"]', ""))
    messages = run_distributed(_forward_error, 2, str(missing), timeout=300)
    for message in messages:
        assert "attention module context_embedder.token_refiner" in message, message
        assert "add 'context_embedder' to the var `replicated_modules` of specs/hunyuanvideo.toml patch 2" in message


def test_a_processor_of_the_same_name_as_the_generated_one_is_told_apart() -> None:
    """Upstream's processor class beside its generated copy of the same name: the refusal qualifies both (it said
    "has AttnProcessor2_0 ... SP-aware here: AttnProcessor2_0") and names the module the class came from."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from runtime.diffusion.sp import _check_processors
    from tests.dit.cases import CASES, shell

    model = shell(CASES["flux"])
    generated = type(model.transformer_blocks[0].attn.processor)
    model.transformer_blocks[0].attn.set_processor(FluxAttnProcessor())
    with pytest.raises(ValueError) as caught:
        _check_processors(model, (generated,), (), "specs/flux.toml patch 1")
    message = str(caught.value)
    upstream = "diffusers.models.transformers.transformer_flux.FluxAttnProcessor"
    assert f"transformer_blocks.0.attn has {upstream}, which is not SP-aware" in message, message
    assert f"(SP-aware here: {generated.__module__}.FluxAttnProcessor)" in message, message
    assert "upstream's class of that name, not the generated copy" in message, message
