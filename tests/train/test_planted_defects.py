"""Silent defects planted into copies of a shipped spec and a shipped template are caught before step 1.

Each defect is the kind that trained wrong numbers with exit 0 on a model the project had never seen: a DiT spec
with the training shell only (every SP rank runs the whole model, so every gradient is counted twice), a DiT
attention kind that never enters the split (each rank attends to its own tokens only), and a loss template that
computes upstream's local loss under SP (labels shifted within the rank's slice, a mean over the rank's tokens
only). Both regenerate cleanly (regen cannot know the maths is wrong); the copies are regenerated into
a temporary project and the start-up self-check runs the job's layout with the generated class
(``tests/train/self_check_defects.py``). The launcher's ``check_supported`` refuses the shell-only spec even
earlier (tests/train/test_supports.py); here the self-check alone is shown to stop it.

A model whose sequence mixer carries state across packed documents (a copy of the qwen3_next spec whose record no
longer states the row's boundaries) is refused when the trainer builds it, one line naming the mixer
(``runtime/train/packed_documents.py``). A split carried on the wrong argument and upstream's checkpointing branch
without the split: tests/train/test_planted_defects_dit.py.
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


def _project(
    root: Path, spec_text: str, bodies: dict[str, str] | None = None, name: str = "qwen3", output: str | None = None
) -> Path:
    """A project with a copy of the shipped templates (``bodies``: template name -> the body its copy renders
    instead, header kept) and one spec; regenerated; the path of the generated module (``output``, else the qwen3
    or flux copy's)."""
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
    return root / (output or (OUTPUT if name == "qwen3" else DIT_OUTPUT))


def shipped(name: str, output: str) -> str:
    """The text of shipped spec ``name`` with its output moved to ``output``."""
    return re.sub(r'output = "[^"]*"', f'output = "{output}"', (REPO / "specs" / f"{name}.toml").read_text(), count=1)


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


NEXT_OUTPUT = "generated/planted_next/modeling_qwen3_next.py"
STATED = 'packed_documents = "cu_seq_lens"'
REFUSED = "carries state from one packed document into the next, and the trainer packs several documents per row"


def _packed_check(entry: object, model_class: type | None = None, model_type: str | None = None) -> str:
    """The trainer's start-up check of packed rows on a real-sized job config: its one-line error, or ""."""
    from runtime.config.errors import ConfigError
    from runtime.train.packed_documents import check_packed_documents
    from tests.train.self_check_defects import job_config

    try:
        check_packed_documents(entry, job_config(model_type or entry.model_type), model_class)
    except ConfigError as exc:
        assert len(exc.messages) == 1 and "\n" not in exc.messages[0], exc.messages
        return exc.messages[0]
    return ""


def test_packed_rows_through_a_recurrence_without_boundaries_are_refused(tmp_path: Path) -> None:
    """A copy of the qwen3_next spec whose record does not state the row's boundaries (its gated delta-net carries
    its state across packed documents): refused in one line naming the mixer; the shipped record is accepted."""
    import dataclasses
    import json

    from runtime.models.registry import lookup

    spec = shipped("qwen3_next", NEXT_OUTPUT)
    assert spec.count(STATED) == 1
    path = _project(tmp_path, spec.replace(STATED, ""), name="qwen3_next", output=NEXT_OUTPUT)
    record = json.loads(path.with_name("modeling_qwen3_next.model.json").read_text())
    assert "packed_documents" not in record["data"]
    copy = dataclasses.replace(lookup("qwen3_next"), data=record["data"])
    error = _packed_check(copy, _load(str(path)).Qwen3NextForCausalLM)
    assert error.startswith(f"model.type: qwen3_next: model.layers.0.linear_attn (Qwen3NextGatedDeltaNet) {REFUSED}")
    assert error.endswith(f"([model.data] {STATED}, with patches that restart the mixer at cu_seq_lens_q)"), error
    assert _packed_check(lookup("qwen3_next")) == ""  # the shipped record: the trainer passes the boundaries


def test_packed_rows_are_checked_by_behaviour_not_by_name() -> None:
    """Softmax attention (qwen3) is accepted; a per-token module that carries state along the row (qwen3's MLP made
    a running mean: no name announces it) is refused, and so is a record that states boundaries it does not honour."""
    import dataclasses

    from runtime.models.registry import lookup
    from tests.train.self_check_defects import RecurrentQwen3

    assert _packed_check(lookup("qwen3")) == ""
    error = _packed_check(lookup("qwen3"), RecurrentQwen3)
    assert error.startswith(f"model.type: qwen3: model.layers.0.mlp (_RunningMean) {REFUSED}"), error
    stated = dataclasses.replace(lookup("qwen3"), data={"packed_documents": "cu_seq_lens"})
    error = _packed_check(stated, RecurrentQwen3)
    assert error == (
        "model.type: qwen3: model.layers.0.mlp (_RunningMean) carries state from one packed document into the next "
        "even given the row's boundaries (cu_seq_lens_q/k): its patches must restart it at them"
    ), error
