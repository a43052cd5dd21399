"""A multi-module spec on real diffusers sources: SD3's transformer with its joint attention processor
(`attention_processor.py`) and block (`attention.py`) as companions regenerates, compiles, imports, and runs
bitwise like upstream (tests/fixtures/specs/sd3_companions.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.engine.helpers import FIXTURES, REPO

SPEC = FIXTURES / "specs" / "sd3_companions.toml"

PARITY = """
import logging, torch
from diffusers import SD3Transformer2DModel as Upstream
from generated.sd3_dit.transformer_sd3 import SD3Transformer2DModel
config = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
              joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
              pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
torch.manual_seed(0)
upstream = Upstream(**config)
model = SD3Transformer2DModel(**config)
model.load_state_dict(upstream.state_dict())
inputs = (torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.randn(2, 12), torch.tensor([3.0, 7.0]))
expected = upstream(*inputs).sample
got = model(*inputs, joint_attention_kwargs={"dit_sp": None}).sample
block = model.transformer_blocks[0]
print(torch.equal(expected, got), type(block).__module__, type(block.attn.processor).__module__)
"""


def project(tmp_path: Path, spec: str) -> Path:
    for name in ("pyproject.toml", "templates"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "sd3.toml").write_text(spec)
    return tmp_path


def test_sd3_with_its_processor_and_block_as_companions_runs_like_upstream(tmp_path: Path) -> None:
    root = project(tmp_path, SPEC.read_text())
    config = load_config(root)
    regen(config, load_specs(config, None))
    folder = root / "generated" / "sd3_dit"
    assert sorted(p.name for p in folder.glob("*.py")) == [
        "__init__.py",
        "attention.py",
        "attention_processor.py",
        "transformer_sd3.py",
    ]
    processor = (folder / "attention_processor.py").read_text()
    assert "        *args,\n        dit_sp=None,\n        **kwargs,\n    ) -> torch.FloatTensor:" in processor
    assert "class Attention(" not in processor and "class AttnProcessor2_0" not in processor
    assert (
        "from generated.sd3_dit.attention import JointTransformerBlock\n"
        in (folder / "transformer_sd3.py").read_text()
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PARITY], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "generated.sd3_dit.attention", "generated.sd3_dit.attention_processor"]
    assert "are not expected by" not in done.stderr  # the processor takes dit_sp: diffusers passes it on


def test_without_the_block_companion_the_unpatched_processor_would_run(tmp_path: Path) -> None:
    spec = SPEC.read_text().replace(
        '[[companion]]\nmodule = "diffusers.models.attention"\nkeep = ["JointTransformerBlock"]\n', ""
    )
    root = project(tmp_path, spec)
    config = load_config(root)
    with pytest.raises(
        PatchgenError,
        match=(
            r"transformer_sd3.py imports JointTransformerBlock from diffusers.models.attention \(upstream\), whose "
            r"definition in diffusers.models.attention uses JointAttnProcessor2_0, which companion "
            r"'attention_processor' "
            r"redefines"
        ),
    ):
        regen(config, load_specs(config, None))
    assert not (root / "generated").exists()
