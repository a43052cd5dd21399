"""Silent defects planted into copies of a shipped spec and a shipped template are caught before step 1.

Each defect is the kind that trained wrong numbers with exit 0 on a model the project had never seen: a DiT spec
with the training shell only (every SP rank runs the whole model, so every gradient is counted twice), a DiT
attention kind that never enters the split (each rank attends to its own tokens only), and a loss template that
computes upstream's local loss under SP (labels shifted within the rank's slice, a mean over the rank's tokens
only). Both regenerate cleanly (regen cannot know the maths is wrong); the copies are regenerated into
a temporary project and the start-up self-check runs the job's layout with the generated class
(``tests/train/self_check_defects.py``). The launcher's ``check_supported`` refuses the shell-only spec even
earlier (tests/train/test_supports.py); here the self-check alone is shown to stop it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.dist_utils import run_distributed
from tests.engine.helpers import REPO
from tests.train.common import TINY_MODEL, run_config

OUTPUT = "generated/planted/modeling_qwen3.py"
DIT_OUTPUT = "generated/planted_dit/transformer_flux.py"
# an attention kind that never enters the split: each SP rank attends to its own tokens (and the text) only
NO_SPLIT = "{{ state }} = None\n"
LOCAL_LOSS = (
    "logits = self.lm_head({{ hidden }})\n"
    "loss = None if labels is None else self.loss_function(logits, labels, {{ vocab_size }}, **kwargs)\n"
)


def _project(root: Path, spec_text: str, bodies: dict[str, str] | None = None, name: str = "qwen3") -> Path:
    """A project with a copy of the shipped templates (``bodies``: template name -> the body its copy renders
    instead, header kept) and one spec; regenerated; the path of the generated module."""
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(REPO / "templates", root / "templates")
    for template_name, body in (bodies or {}).items():
        template = root / "templates" / f"{template_name}.py.j2"
        header = template.read_text().split("#}\n", 1)[0]
        template.write_text(header + "#}\n" + body)
    (root / "specs").mkdir()
    (root / "specs" / f"{name}.toml").write_text(spec_text)
    config = load_config(root)
    regen(config, load_specs(config, [name]))
    return root / (OUTPUT if name == "qwen3" else DIT_OUTPUT)


def _shipped_spec() -> str:
    return re.sub(r'output = "[^"]*"', f'output = "{OUTPUT}"', (REPO / "specs" / "qwen3.toml").read_text(), count=1)


def _shipped_flux() -> str:
    return re.sub(r'output = "[^"]*"', f'output = "{DIT_OUTPUT}"', (REPO / "specs" / "flux.toml").read_text(), count=1)


def _shell_only_flux() -> str:
    """The shipped flux spec with its SP patches taken out: the training shell alone."""
    head, *blocks = _shipped_flux().split("[[patch]]")
    kept = [b for b in blocks if 'template = "dit/training_shell"' in b]
    assert len(kept) == 1 and len(blocks) > 1
    return "[[patch]]".join([head, *kept])


def _load(path: str) -> object:
    name = f"patchgen_planted_{Path(path).parents[2].name}"  # the project's own (unique) temporary directory
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    shell_only = _project(tmp_path_factory.mktemp("shell_only"), _shell_only_flux(), name="flux")
    flux = _shipped_flux()
    no_split = _project(tmp_path_factory.mktemp("no_split"), flux, {"dit/ulysses_to_heads": NO_SPLIT}, name="flux")
    local_loss = _project(tmp_path_factory.mktemp("local_loss"), _shipped_spec(), {"loss/causal_lm_head": LOCAL_LOSS})
    assert "token_shard(" not in shell_only.read_text()
    assert "attention_split(" not in no_split.read_text() and "token_shard(" in no_split.read_text()
    assert "causal_lm_logits_and_loss(" not in local_loss.read_text()
    return {"shell only": shell_only, "no split": no_split, "local loss": local_loss}


def local_loss_worker(rank: int, world_size: int, raw: dict, path: str) -> tuple[str, str]:
    """The text self-check of ``raw`` with the generated class of the module at ``path``."""
    from tests.train.self_check_defects import check_worker

    return check_worker(rank, world_size, raw, _load(path).Qwen3ForCausalLM, {})


def shell_only_worker(rank: int, world_size: int, path: str) -> tuple[str, str]:
    """The DiT self-check of flux at sp = world size with the generated training class of the module at ``path``."""
    from tests.train.self_check_defects import dit_check_worker

    shell = _load(path).FluxTransformer2DModelForTraining
    return dit_check_worker(rank, world_size, "flux", {"sp_size": world_size}, {}, model_class=shell)


@pytest.mark.dist
def test_a_loss_template_computing_the_local_loss_is_caught(tmp_path: Path, planted: dict[str, Path]) -> None:
    raw = run_config(tmp_path, parallel={"sp": 2}, model={"config": TINY_MODEL})
    results = run_distributed(local_loss_worker, 2, raw, str(planted["local loss"]), timeout=300)
    for out, error in results:
        assert error == results[0][1] and "\n" not in error and "self-check: passed" not in out, results
    assert results[0][1].startswith("train.self_check: the start-up self-check failed: "), results[0][1]
    assert "tolerance 1e-04" in results[0][1] and "sp 2" in results[0][1]


@pytest.mark.dist
@pytest.mark.parametrize("defect", ["shell only", "no split"])
def test_a_dit_whose_attention_is_not_split_is_caught(planted: dict[str, Path], defect: str) -> None:
    """The shipped flux spec with its SP patches taken out (every gradient counted twice), and the shipped spec over
    a copy of the dit/ulysses_to_heads template that never enters the split (each rank attends to its own tokens)."""
    results = run_distributed(shell_only_worker, 2, str(planted[defect]), timeout=300)
    for line, error in results:
        assert error and "\n" not in error and not line, results
    # the checked-site guard fires in the proof's forward: no attention module passes an SP site
    assert (
        "(FluxAttention) ran under parallel.sp = 2 without passing through a patched attention site" in (results[0][1])
    )
