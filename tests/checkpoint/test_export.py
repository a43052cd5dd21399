"""Export of a plain (single-process) model: plain transformers loads it and gives bitwise-equal logits."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from runtime.checkpoint import export_hf
from runtime.checkpoint.export import EXPORT_MARKER, ExportTargetError
from tests.checkpoint.common import build, train


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 97)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def _trained(model_type: str, **overrides):
    with torch.random.fork_rng(devices=[]):
        config, model, optimizer, scheduler = build(model_type, **overrides)
        train(model, optimizer, scheduler, 0, 1)  # trained weights; with untied embeddings lm_head != embed_tokens
    return config, model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.parametrize("tie", [False, True])
def test_export_round_trip(tmp_path: Path, tie: bool) -> None:
    config, model = _trained("qwen3", tie_word_embeddings=tie, attention_dropout=0.1)
    runtime_config = copy.deepcopy(config)
    runtime_config._attn_implementation = "ulysses_sdpa"  # what an SP run's config carries; must not be saved
    out = tmp_path / "hf"
    assert export_hf(model, runtime_config, out, tokenizer=_tokenizer() if tie else None) == out
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())

    text = (out / "config.json").read_text()
    assert "ulysses" not in text
    saved = json.loads(text)
    assert saved["architectures"] == ["Qwen3ForCausalLM"] and saved["tie_word_embeddings"] is tie
    assert isinstance(AutoConfig.from_pretrained(out), type(config))

    upstream = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    assert type(upstream).__module__ == "transformers.models.qwen3.modeling_qwen3"
    assert (upstream.lm_head.weight is upstream.model.embed_tokens.weight) is tie
    ours = _logits(model)
    assert torch.equal(_logits(upstream), ours)
    eager = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(_logits(eager), ours, rtol=1e-5, atol=1e-5)
    if tie:
        assert AutoTokenizer.from_pretrained(out)("w3 w5")["input_ids"] == [3, 5]


def test_sharded_export_replaces_previous(tmp_path: Path) -> None:
    config, model = _trained("llama")
    out = tmp_path / "hf"
    export_hf(model, config, out)
    assert (out / "model.safetensors").is_file()
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["files"] == sorted(p.name for p in out.iterdir())
    with pytest.raises(ExportTargetError, match="earlier export; set export.overwrite: true"):
        export_hf(model, config, out)
    # several files and an index, replacing the first export
    export_hf(model, config, out, max_shard_bytes=40_000, overwrite=True)
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    upstream = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    assert torch.equal(_logits(upstream), _logits(model))


def test_export_casts_dtype(tmp_path: Path) -> None:
    config, model = _trained("qwen3")
    export_hf(model, config, tmp_path / "bf16", dtype=torch.bfloat16)
    upstream = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert upstream.dtype == torch.bfloat16 and config.dtype != torch.bfloat16  # the caller's config is untouched
    ref = model.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(upstream.model.embed_tokens.weight, ref)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_never_replaces_a_directory_it_did_not_write(tmp_path: Path) -> None:
    config, model = _trained("qwen3")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ExportTargetError, match="not an earlier export"):
        export_hf(model, config, mine, overwrite=True)
    leftover = tmp_path / ".hf.tmp"  # named like an export's temporary directory, but the user's
    leftover.mkdir()
    (leftover / "data.bin").write_bytes(b"1")
    with pytest.raises(ExportTargetError, match="leftover"):
        export_hf(model, config, tmp_path / "hf")
    assert (mine / "notes.txt").read_text() == "keep" and (leftover / "data.bin").is_file()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2_5_vl"])
def test_exported_configs_are_what_upstream_save_pretrained_writes(tmp_path: Path, model_type: str) -> None:
    """The trainer turns the KV cache off (``use_cache: false`` in the config and its text config); the exported
    config.json and generation_config.json are upstream's for the same model, field by field: plain ``generate``
    runs with a KV cache, as from the upstream checkpoint. Documented differences: none for these keys."""
    from runtime.models.registry import REGISTRY
    from runtime.models.tiny_configs import tiny_config

    entry = REGISTRY[model_type]
    config = tiny_config(model_type)
    torch.manual_seed(0)
    published = copy.deepcopy(config)  # the spec's tiny config turns the cache off; a published config has it on
    text = published.get_text_config()
    assert type(text)().use_cache is True
    text.use_cache = True
    upstream = entry.upstream_class().from_config(published)
    upstream.save_pretrained(tmp_path / "upstream")
    ours = entry.model_class()(copy.deepcopy(config))
    ours.config.use_cache = False  # as runtime/train/model.py builds every trained model
    ours.config.get_text_config().use_cache = False
    export_hf(ours, ours.config, tmp_path / "ours")
    for name in ("config.json", "generation_config.json"):
        theirs = json.loads((tmp_path / "upstream" / name).read_text())
        mine = json.loads((tmp_path / "ours" / name).read_text())
        differing = {k: (mine.get(k), theirs.get(k)) for k in {*mine, *theirs} if mine.get(k) != theirs.get(k)}
        assert mine == theirs, (name, differing)
    assert AutoConfig.from_pretrained(tmp_path / "ours").get_text_config().use_cache is True
