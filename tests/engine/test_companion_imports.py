"""A module that uses a processor class it never imports: PixArt's blocks build diffusers' ``Attention``, which picks
``AttnProcessor2_0`` itself. Listing that class in ``dit/shard_tokens``' processors, with ``attention_processor`` a
companion keeping it, makes the generated module import the spec's (SP-aware) copy, so the run-time check compares
against the class the model really runs (tests/fixtures/specs/pixart_companion_import.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchgen.config import load_config
from patchgen.errors import PatchgenError
from patchgen.project import regen
from patchgen.spec_set import load_specs
from tests.engine.helpers import FIXTURES
from tests.engine.test_companions_diffusers import project

SPEC = (FIXTURES / "specs" / "pixart_companion_import.toml").read_text()

RUN = """
import torch
from diffusers import PixArtTransformer2DModel as Upstream
from generated.pixart_dit import pixart_transformer_2d as generated
config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
              cross_attention_dim=16, caption_channels=16, sample_size=8, patch_size=2)
torch.manual_seed(0)
upstream = Upstream(**config)
model = generated.PixArtTransformer2DModel(**config)
model.load_state_dict(upstream.state_dict())
kwargs = dict(encoder_hidden_states=torch.randn(2, 5, 16), timestep=torch.tensor([3, 700]),
              added_cond_kwargs={"resolution": None, "aspect_ratio": None})
x = torch.randn(2, 4, 8, 8)
same = torch.equal(upstream(x, **kwargs).sample, model(x, **kwargs).sample)
processors = {type(m.processor) for m in model.modules() if hasattr(m, "processor")}
print(same, processors == {generated.AttnProcessor2_0}, generated.AttnProcessor2_0.__module__)
"""


def test_a_processor_the_module_never_imports_is_imported_from_its_companion(tmp_path: Path) -> None:
    root = project(tmp_path, SPEC)
    config = load_config(root)
    regen(config, load_specs(config, None))
    text = (root / "generated" / "pixart_dit" / "pixart_transformer_2d.py").read_text()
    assert (
        "# patchgen companion classes (1 stmt): the spec's copies, which the patches below name\n"
        "from generated.pixart_dit.attention_processor import AttnProcessor2_0\n"
    ) in text
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "generated.pixart_dit.attention_processor"]


def test_without_the_companion_the_refusal_says_how_to_list_it(tmp_path: Path) -> None:
    spec = SPEC.replace('keep = ["Attention", "AttnProcessor2_0"]', 'keep = ["Attention"]')
    root = project(tmp_path, spec)
    config = load_config(root)
    with pytest.raises(PatchgenError) as caught:
        regen(config, load_specs(config, None))
    message = str(caught.value)
    assert "vars.processors = 'AttnProcessor2_0' names no definition or import" in message, message
    assert "keep it in a [[companion]] of that module, and the generated module imports the spec's copy" in message
