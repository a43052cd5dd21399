"""The training shell takes diffusers' documented ``from_pretrained`` / ``save_pretrained`` arguments: each one is
honoured (dtype / torch_dtype, variant, subfolder, output_loading_info, is_main_process, the pipeline loader's
no-op arguments) or refused with one clear error, never swallowed as a config override."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.diffusion.shell import _keep_in_fp32
from tests.dit.cases import CASES, shell

CASE = CASES["wan"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    model = shell(CASE)
    path = tmp_path_factory.mktemp("wan")
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("name", ["dtype", "torch_dtype"])
def test_dtype_and_torch_dtype_are_honoured(saved, name) -> None:
    path, model = saved
    loaded = CASE.shell_class.from_pretrained(path, **{name: torch.bfloat16})
    assert {p.dtype for p in loaded.parameters()} <= {torch.bfloat16, torch.float32}
    assert loaded.patch_embedding.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.patch_embedding.weight, model.patch_embedding.weight.to(torch.bfloat16))


def test_conflicting_dtypes_are_refused(saved) -> None:
    with pytest.raises(ValueError, match="dtype and torch_dtype differ"):
        CASE.shell_class.from_pretrained(saved[0], dtype=torch.bfloat16, torch_dtype=torch.float16)


def test_variant_round_trip_in_plain_diffusers(saved, tmp_path) -> None:
    path, model = saved
    model.save_pretrained(tmp_path, variant="fp16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "diffusion_pytorch_model.fp16.safetensors"]
    plain = CASE.upstream_class.from_pretrained(tmp_path, variant="fp16")
    ours = CASE.shell_class.from_pretrained(tmp_path, variant="fp16")
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value) and torch.equal(ours.state_dict()[key], value), key
    with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model.safetensors"):
        CASE.shell_class.from_pretrained(tmp_path)  # no default variant there


def test_sharded_variant_round_trip(saved, tmp_path) -> None:
    _, model = saved
    model.save_pretrained(tmp_path, variant="ema", max_shard_size="20KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.ema.json").is_file()
    plain = CASE.upstream_class.from_pretrained(tmp_path, variant="ema")
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_not_the_main_process_writes_nothing(saved, tmp_path) -> None:
    saved[1].save_pretrained(tmp_path / "out", is_main_process=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_map": "cuda"}, "device_map='cuda' is not supported"),
        ({"quantization_config": {"load_in_8bit": True}}, "quantization_config="),
        ({"use_safetensors": False}, "only safetensors"),
        ({"num_layrs": 3}, r"unknown argument\(s\) \['num_layrs'\]"),
    ],
)
def test_unsupported_loading_arguments_are_refused(saved, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        CASE.shell_class.from_pretrained(saved[0], **kwargs)


def test_the_pipeline_loaders_arguments_are_accepted(saved) -> None:
    """What DiffusionPipeline.from_pretrained passes a PreTrainedModel component (diffusers 0.40.0)."""
    model = CASE.shell_class.from_pretrained(
        saved[0],
        dtype=torch.float32,
        device_map=None,
        max_memory=None,
        offload_folder=None,
        offload_state_dict=False,
        variant=None,
        use_safetensors=None,
        low_cpu_mem_usage=True,
        disable_mmap=False,
    )
    assert not model.training


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"safe_serialization": False}, "safe_serialization=False"), ({"push_to_hub": True}, "push_to_hub=True")],
)
def test_unsupported_saving_arguments_are_refused(saved, tmp_path, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        saved[1].save_pretrained(tmp_path, **kwargs)


def test_unexpected_weights_load_as_upstream_and_are_reported(saved, tmp_path) -> None:
    path, model = saved
    weights = load_file(str(path / "diffusion_pytorch_model.safetensors"))
    weights["extra.weight"] = torch.randn(2)
    save_file(weights, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    plain, plain_info = CASE.upstream_class.from_pretrained(tmp_path, output_loading_info=True)
    ours, info = CASE.shell_class.from_pretrained(tmp_path, output_loading_info=True)
    assert info["unexpected_keys"] == plain_info["unexpected_keys"] == ["extra.weight"]
    assert info["missing_keys"] == plain_info["missing_keys"] == []


def test_a_bare_string_keep_in_fp32_names_one_module() -> None:
    model = shell(CASE).to(torch.bfloat16)
    model._keep_in_fp32_modules = "proj_out"
    _keep_in_fp32(model, torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["proj_out.weight"] == dtypes["proj_out.bias"] == torch.float32
    assert dtypes["patch_embedding.weight"] == torch.bfloat16
