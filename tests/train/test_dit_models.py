"""The DiT trainer on every DiT spec's tiny cases (tests/dit/cases.py: each spec's tiny config and variants, e.g.
Wan T2V and I2V, Flux, Qwen-Image and its zero_cond_t variant, HunyuanVideo), with no per-model code here:

* SP=2 vs one process, per step (loss, grad norm) within the rounding model (tests.tolerance), LoRA, all cases in
  one 2-rank spawn;
* conditions computed on the fly vs read from the cache: the same losses, bitwise;
* the LoRA export loads through the plain diffusers pipeline's ``load_lora_weights`` (a pipeline without it,
  PixArt-Sigma's: peft's ``PeftModel.from_pretrained`` on its transformer) and reproduces the in-memory LoRA model
  bitwise (Wan I2V within 1e-6: diffusers' Wan loader adds zero LoRA layers to an I2V model's image K/V
  projections, ``_maybe_expand_t2v_lora_for_i2v``, which changes the rounding, not the function).

Data: video cases train on synthetic clips (MP4 and frame folders), image cases on synthetic PNGs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.dit.cases import CASES, Case, inputs
from tests.supports import has, require
from tests.tolerance import assert_steps_within_rounding
from tests.train.dit_common import per_step, reference_steps, train_in_process

NAMES = sorted(CASES)
SP_NAMES = [name for name in NAMES if has(CASES[name].model_type, "sp")]  # the others: test_every_dit_runs_at_sp...
LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from runtime.data.dit.synthetic import write_synthetic_clips, write_synthetic_images
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    root = tmp_path_factory.mktemp("dit_models")
    out: dict[str, Path] = {name: save_tiny_pipeline(name, root / name) for name in NAMES}
    # long enough for every video case's bucket (_config: 2 latent frames after the first; LTX-Video's 8x VAE: 17)
    frames = max(2 * CASES[n].condition_class.temporal_multiple + 1 for n in NAMES if CASES[n].condition_class.video)
    out["clips"] = write_synthetic_clips(root / "clips", 4, frames, 32, 32, seed=0, frame_folders_every=2)
    out["images"] = write_synthetic_images(root / "images", 4, 32, 48, seed=1)
    out["root"] = root
    return out


def _config(files: dict[str, Path], case: Case, work: Path, **sections: Any) -> dict:
    video = case.condition_class.video
    frames = 2 * case.condition_class.temporal_multiple + 1
    width = 48 if 48 % case.condition_class.pixel_multiple == 0 else 64  # Sana: multiples of 32 (its pipeline's)
    raw = {
        "model": {"type": case.model_type, "path": str(files[case.name]), "seed": 0},
        "data": {
            "path": str(files["clips" if video else "images"]),
            "buckets": [[frames, 32, 32]] if video else [[32, width]],
            "cache": str(files["root"] / f"cache-{case.name}"),
        },
        "optim": {"lr": 2e-3},
        "train": {"steps": 2},
        "lora": copy.deepcopy(LORA),
        "log": {"dir": str(work / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _train_all(rank: int, world_size: int, configs: list[dict]) -> list[list[tuple[float, float]]]:
    return [per_step(train_in_process(raw)) for raw in configs]


@pytest.mark.parametrize("model_type", sorted({CASES[name].model_type for name in NAMES}))
def test_every_dit_runs_at_sp_or_states_why(model_type: str) -> None:
    require(model_type, "sp")


@pytest.mark.dist
def test_sp2_matches_one_process_for_every_dit(files: dict[str, Path], tmp_path: Path) -> None:
    references, witnesses = reference_steps([_config(files, CASES[n], tmp_path / f"ref-{n}") for n in SP_NAMES])
    sp = [_config(files, CASES[n], tmp_path / f"sp-{n}", parallel={"sp": 2}) for n in SP_NAMES]
    per_rank = run_distributed(_train_all, 2, sp, timeout=600)
    for got, ref, witness, name in zip(per_rank[0], references, witnesses, SP_NAMES, strict=True):
        assert_steps_within_rounding(got, ref, witness, name)
    assert per_rank[0] == per_rank[1]  # every rank reports the global loss


@pytest.mark.parametrize("name", NAMES)
def test_cached_equals_on_the_fly(name: str, files: dict[str, Path], tmp_path: Path) -> None:
    case = CASES[name]
    live = per_step(train_in_process(_config(files, case, tmp_path / "live", data={"cache": None})))
    cache = {"cache": str(tmp_path / "cache")}
    first = per_step(train_in_process(_config(files, case, tmp_path / "fill", data=cache)))  # fills the cache
    cached = per_step(train_in_process(_config(files, case, tmp_path / "read", data=cache)))  # reads it back
    assert live == first == cached


@pytest.mark.parametrize("name", NAMES)
def test_lora_export_loads_in_the_plain_pipeline(name: str, files: dict[str, Path], tmp_path: Path) -> None:
    case = CASES[name]
    result = train_in_process(
        _config(files, case, tmp_path / "run", optim={"lr": 2e-2}, export={"dir": str(tmp_path / "lora")})
    )
    ours = result.model.eval()
    pipe = case.condition_class.tiny_pipeline_class(case.variant).from_pretrained(files[name])
    kwargs = inputs(case)
    with torch.no_grad():
        base = pipe.transformer(**kwargs)[0]
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(tmp_path / "lora")
            loaded = pipe.transformer
        else:  # no LoRA loader in diffusers (PixArt-Sigma): the export is peft's adapter directory
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(pipe.transformer, tmp_path / "lora")
        expected = ours(**kwargs)[0]
        got = loaded(**kwargs)[0]
        if any(".add_k_proj.lora_A" in n for n, _ in pipe.transformer.named_modules()):  # the loader's zero layers
            assert not any("add_k_proj.lora_A" in n for n, _ in ours.named_modules())
            assert ((got - expected).norm() / expected.norm()).item() < 1e-6
        else:
            assert torch.equal(got, expected)
        assert not torch.equal(base, expected)


def test_a_transformer_checkpoint_with_unknown_weights_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """The shell loads it as diffusers does (reported in loading_info); the trainer refuses it naming the key."""
    import shutil

    from safetensors.torch import load_file, save_file

    from runtime.config.errors import ConfigError

    case = CASES["flux"]
    pipe = tmp_path / "pipe"
    shutil.copytree(files[case.name], pipe)
    weights_file = pipe / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(weights_file)
    weights["transformer_blocks.0.extra.weight"] = torch.randn(3)
    save_file(weights, weights_file)
    raw = _config(files, case, tmp_path / "run")
    raw["model"]["path"] = str(pipe)
    with pytest.raises(ConfigError, match=r"1 weight\(s\) .* does not have: transformer_blocks\.0\.extra\.weight"):
        train_in_process(raw)
