"""The DiT trainer end to end on tiny random pipelines and real files (MP4 clips, frame folders, PNG images):

* SP=2 vs one process, per step (loss, grad norm) within the rounding model (``tests.tolerance``), for Wan
  (activation checkpointing on) and Flux (LoRA); FSDP over 2 ranks (Wan) and HSDP over 2 replicas (Flux) vs one
  process with 2 micro-batches; FSDP+SP resume is bitwise. All in one 2-rank spawn.
* cached vs on-the-fly conditions: the same losses, bitwise; a changed clip is recomputed, the rest read back;
* resume with EMA: steps after the checkpoint and the exported (EMA) weights are bitwise those of the straight run;
* exports: the full pipeline directory loads in plain diffusers (``WanPipeline``) and its transformer reproduces
  the in-memory model bitwise; the LoRA file loads through ``FluxPipeline.load_lora_weights`` and reproduces the
  in-memory LoRA model bitwise; the fused export within float rounding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.dist_utils import run_distributed
from tests.tolerance import assert_steps_within_rounding, assert_within_rounding
from tests.train.dit_common import dit_config, dit_worker, make_files, per_step, reference_steps, train_in_process


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny models on a shared 2-core machine: intra-op threads cost wall time and change no result here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_files(tmp_path_factory.mktemp("dit_train"))


def _inputs_wan(model: torch.nn.Module) -> dict:
    g = torch.Generator().manual_seed(11)
    c = model.config
    return {
        "hidden_states": torch.randn(2, c.in_channels, 3, 4, 6, generator=g),
        "timestep": torch.tensor([100.0, 700.0]),
        "encoder_hidden_states": torch.randn(2, 7, c.text_dim, generator=g),
        "return_dict": False,
    }


def _inputs_flux(model: torch.nn.Module) -> dict:
    g = torch.Generator().manual_seed(12)
    c = model.config
    rows, cols = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(6, 3).float()
    return {
        "hidden_states": torch.randn(2, 6, c.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, c.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(2, c.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([0.3, 0.8]),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(5, 3),
        "guidance": torch.full((2,), 3.5),
        "return_dict": False,
    }


@pytest.mark.dist
def test_sp_fsdp_hsdp_match_one_process_and_resume(files: dict[str, Path], tmp_path: Path) -> None:
    wan_sp = dit_config(
        files,
        "wan",
        tmp_path / "wan_sp",
        parallel={"sp": 2, "activation_checkpointing": True},
        train={"steps": 4},
        checkpoint={"dir": str(tmp_path / "wan_sp_ckpt"), "interval": 2},
    )
    flux_lora = {"rank": 4, "alpha": 8}
    flux_sp = dit_config(
        files,
        "flux",
        tmp_path / "flux_sp",
        parallel={"ring": 2},  # context parallelism through the ring (Wan above: Ulysses)
        lora=flux_lora,
        train={"steps": 4},
        checkpoint={"dir": str(tmp_path / "flux_sp_ckpt"), "interval": 2},
    )
    ema = {"ema_decay": 0.5}  # FSDP: EMA shards updated locally, gathered for the export
    wan_fsdp = dit_config(
        files, "wan", tmp_path / "wan_fsdp", data={"batch_size": 2}, dit=ema, export={"dir": str(tmp_path / "e2")}
    )
    flux_hsdp = dit_config(files, "flux", tmp_path / "flux_hsdp", parallel={"dp_replicate": 2})
    cases = [{**wan_sp, "resume_from_step": 2}, {**flux_sp, "resume_from_step": 2}, wan_fsdp, flux_hsdp]

    references, witnesses = reference_steps(
        [
            dit_config(files, "wan", tmp_path / "ref0", train={"steps": 4}),
            dit_config(files, "flux", tmp_path / "ref1", lora=flux_lora, train={"steps": 4}),
            dit_config(
                files,
                "wan",
                tmp_path / "ref2",
                data={"batch_size": 2},
                train={"micro_batches": 2},
                dit=ema,
                export={"dir": str(tmp_path / "e1")},
            ),
            dit_config(files, "flux", tmp_path / "ref3", train={"micro_batches": 2}),
        ]
    )
    per_rank = run_distributed(dit_worker, 2, cases, timeout=300)
    for rank in per_rank:
        for index in (0, 1):  # steps 3-4 after resuming from the step-2 checkpoint: bitwise (full FT, LoRA)
            straight, resumed = rank[index]
            assert_steps_within_rounding(straight, references[index], witnesses[index], f"case {index}")
            assert resumed == straight[2:]
        for index in (2, 3):
            assert_steps_within_rounding(rank[index], references[index], witnesses[index], f"case {index}")
    assert per_rank[0] == per_rank[1]  # every rank reports the global loss
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    # a LoRA checkpoint holds the adapter and its optimizer state, not the frozen base weights
    saved = FileSystemReader(str(tmp_path / "flux_sp_ckpt" / "step_000002")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A/" in k or ".lora_B/" in k or "/lora_" in k for k in model_keys), model_keys[:4]

    weights = "transformer/diffusion_pytorch_model.safetensors"
    one, two = load_file(tmp_path / "e1" / weights), load_file(tmp_path / "e2" / weights)
    witness = load_file(tmp_path / "e1-witness" / weights)  # reference_steps' witness of the e1 run
    assert_within_rounding({"weights": two}, {"weights": one}, {"weights": witness}, what="FSDP export")


def test_cached_conditions_equal_on_the_fly_and_follow_the_files(files: dict[str, Path], tmp_path: Path) -> None:
    from runtime.diffusion.cache import ConditionCache

    clips = tmp_path / "clips"
    shutil.copytree(files["clips"].parent, clips)
    cache = tmp_path / "cache"
    cached_raw = dit_config(
        files, "wan", tmp_path / "a", data={"path": str(clips / "data.jsonl"), "cache": str(cache)}, train={"steps": 2}
    )
    from runtime.train.prepare import main as prepare

    config_file = tmp_path / "run.yaml"
    earlier = tmp_path / "hf"  # prepare never exports: an export.dir that training would refuse is not its concern
    earlier.mkdir()
    (earlier / "notes.txt").write_text("keep me")
    config_file.write_text(yaml.safe_dump({**cached_raw, "export": {"dir": str(earlier)}}))
    assert prepare([str(config_file)]) == 0  # `-m runtime.train.prepare` fills the cache ahead of training
    assert [p.name for p in earlier.iterdir()] == ["notes.txt"]
    assert len(ConditionCache(cache)) == 8
    live = per_step(
        train_in_process(
            dit_config(
                files,
                "wan",
                tmp_path / "b",
                data={"path": str(clips / "data.jsonl"), "cache": None},
                train={"steps": 2},
            )
        )
    )
    cached = per_step(train_in_process(cached_raw))
    assert cached == live
    assert len(ConditionCache(cache)) == 8

    # a changed clip is a new key (recomputed); the other seven are read back
    from PIL import Image

    frame = next((clips / "clips").glob("clip_*/frame_000.png"))
    image = Image.open(frame).convert("RGB")
    image.putpixel((0, 0), (1, 2, 3))
    image.save(frame)
    train_in_process(cached_raw)
    assert len(ConditionCache(cache)) == 9


def test_resume_with_ema_is_bitwise(files: dict[str, Path], tmp_path: Path) -> None:
    raw = dit_config(
        files,
        "wan",
        tmp_path / "run",
        train={"steps": 4},
        dit={"ema_decay": 0.9},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2},
        export={"dir": str(tmp_path / "export"), "overwrite": True},
    )
    straight = train_in_process(raw)
    weights = (tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "ckpt" / "step_000004")
    resumed = train_in_process(raw)
    assert resumed.start_step == 2
    assert per_step(resumed) == per_step(straight)[2:]
    assert (tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == weights


def test_full_export_loads_in_plain_diffusers(files: dict[str, Path], tmp_path: Path) -> None:
    import diffusers

    raw = dit_config(files, "wan", tmp_path / "run", train={"steps": 2}, export={"dir": str(tmp_path / "export")})
    result = train_in_process(raw)
    pipe = diffusers.WanPipeline.from_pretrained(tmp_path / "export")
    assert type(pipe.transformer) is diffusers.WanTransformer3DModel
    ours = result.model.eval()
    inputs = _inputs_wan(ours)
    with torch.no_grad():
        assert torch.equal(pipe.transformer(**inputs)[0], ours(**inputs)[0])
        base = diffusers.WanTransformer3DModel.from_pretrained(files["wan"] / "transformer")
        assert not torch.equal(base(**inputs)[0], ours(**inputs)[0])  # training changed the weights


def test_lora_export_loads_in_plain_diffusers(files: dict[str, Path], tmp_path: Path) -> None:
    import diffusers

    raw = dit_config(
        files,
        "flux",
        tmp_path / "run",
        optim={"lr": 2e-2},
        train={"steps": 2},
        lora={"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj"]},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2},
        export={"dir": str(tmp_path / "lora")},
    )
    result = train_in_process(raw)
    ours = result.model.eval()
    inputs = _inputs_flux(ours)
    pipe = diffusers.FluxPipeline.from_pretrained(files["flux"])
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(tmp_path / "lora")
        expected = ours(**inputs)[0]
        assert torch.equal(pipe.transformer(**inputs)[0], expected)
        assert not torch.equal(base, expected)

    # the same run resumed at its end only exports again: fused into full weights this time
    fused = train_in_process({**raw, "export": {"dir": str(tmp_path / "fused"), "fuse_lora": True}})
    assert fused.metrics == [] and fused.start_step == 2
    plain = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "fused" / "transformer")
    with torch.no_grad():
        got = plain(**inputs)[0]
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
