"""An exported text model stops generating at its end-of-turn / eos token under plain transformers ``generate``.

A model trained for two steps rarely emits a stop token by itself, so the test makes it do so at a known step,
without any of our code: greedy decoding with stopping switched off gives the reference tokens g1..g50; swapping
the lm_head rows of a stop token and of g_k (the first fresh token from the third on) leaves every logit before step
k in place and moves step k's winner to the stop token. Plain ``generate`` from the export directory must then
return g1..g(k-1) followed by the stop token; the same swapped model saved the way exports were before
(``eos_token_id: null``, no ``generation_config.json``) runs on to ``max_new_tokens``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.train.common import run_config, run_main

MAX_NEW = 50


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("generate")
    raw = run_config(root, train={"steps": 2}, export={"dir": str(root / "hf")})
    code, err = run_main(raw, root)
    assert code == 0, err
    return root / "hf"


def _prompt(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me what the sea is like."}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def _load(directory: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert type(model).__module__.startswith("transformers.models.")  # the upstream class, not ours
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied: swapping lm_head rows only
    return model


def _greedy(model: torch.nn.Module, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()


def _swap_rows(model: torch.nn.Module, a: int, b: int) -> None:
    with torch.no_grad():
        weight = model.lm_head.weight
        weight[[a, b]] = weight[[b, a]]


def test_export_names_the_tokenizers_stop_tokens(export_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(export_dir)  # saved beside the weights
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == eos and im_end != tokenizer.unk_token_id
    generation = json.loads((export_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [im_end, eos]
    assert generation["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|pad|>")
    assert generation["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|startoftext|>")
    config = json.loads((export_dir / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (eos, generation["bos_token_id"])


@pytest.mark.parametrize("stop", ["<|im_end|>", "<|endoftext|>"])
def test_plain_generate_stops_at_the_stop_token(export_dir: Path, tmp_path: Path, stop: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    prompt = _prompt(tokenizer)

    reference_model = _load(export_dir)
    reference_model.generation_config.eos_token_id = None  # never stop: the reference tokens g1..g50
    reference = _greedy(reference_model, prompt)
    assert len(reference) == MAX_NEW
    fresh = [k for k in range(2, MAX_NEW) if reference[k] not in reference[:k] and stop_id not in reference[: k + 1]]
    assert fresh, f"no fresh greedy token to replace by {stop}: {reference}"
    k = fresh[0]

    model = _load(export_dir)
    _swap_rows(model, stop_id, reference[k])
    got = _greedy(model, prompt)
    assert got == reference[:k] + [stop_id], (got, reference)
    assert tokenizer.decode(got).endswith(stop) and len(got) < MAX_NEW

    # Failing before: the same weights saved as exports were (no generation_config.json, eos_token_id null).
    before = tmp_path / "before"
    shutil.copytree(export_dir, before)
    (before / "generation_config.json").unlink()
    config = json.loads((before / "config.json").read_text())
    config.update(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    (before / "config.json").write_text(json.dumps(config))
    old = _load(before)
    _swap_rows(old, stop_id, reference[k])
    ran_on = _greedy(old, prompt)
    assert len(ran_on) == MAX_NEW and ran_on[k] == stop_id


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_processor_directory_gives_the_same_stop_tokens(tmp_path: Path, model_type: str) -> None:
    """A VLM export is given its processor directory: the ids are read from the tokenizer files in it, and written
    only into config keys the (text) config class has (Qwen3-VL's text config has no bos/eos keys upstream)."""
    import transformers

    from runtime.checkpoint.generation import export_generation_config, set_config_token_ids, special_token_ids
    from runtime.models.tiny_configs import tiny_config_dict
    from runtime.tiny import write_processor

    directory = write_processor(model_type, tmp_path / "proc")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    ids = special_token_ids(directory)
    config = transformers.AutoConfig.for_model(model_type, **tiny_config_dict(model_type))
    declared = set(type(config.text_config)().to_dict())
    set_config_token_ids(config, ids)
    text = config.text_config.to_dict()
    assert ("eos_token_id" in text) == ("eos_token_id" in declared)
    if "eos_token_id" in declared:  # qwen2_5_vl: upstream's default 151645 would lie outside the 512-token vocab
        assert (text["eos_token_id"], text["bos_token_id"]) == (eos, tokenizer.bos_token_id)
    generation = export_generation_config(None, config, ids)
    assert generation.eos_token_id == [im_end, eos] and generation.pad_token_id == tokenizer.pad_token_id
