"""Checkpoints move between generated and upstream classes without loss, both ways, in every layout upstream loads.

- generated -> upstream and upstream -> generated through `save_pretrained` / `from_pretrained`: nothing missing,
  unexpected or mismatched, every weight and the logits identical; the generated model saves exactly the files'
  tensors upstream saves (transformers reverts its load-time conversions on save, e.g. stacked MoE experts back to
  per-expert weights, so this holds only when the generated class shares upstream's conversions).
- every legacy layout: derived from transformers' own conversion mapping for the upstream model (the transforms
  `from_pretrained` applies, plus its global "legacy" renames), not listed per model. Each transform, reversed alone
  by transformers' `revert_weight_conversion`, writes a checkpoint in the layout that transform undoes (Qwen2.5-VL's
  `visual.*` / `model.layers.*` keys, per-expert MoE weights, transposed VL-MoE experts, ...); both classes must load
  each one to the same weights. A model whose upstream class has conversions must yield at least one such layout.
  (transformers 5.14.1 has no per-class `_checkpoint_conversion_mapping` left: the conversion mapping is the only
  source of legacy layouts.)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion

from tests.fidelity.common import MODELS, Mismatches, Pair, kinds, ragged_batch


def _load(cls: Any, path: Path, pair: Pair) -> tuple[Any, dict[str, Any]]:
    """`cls.from_pretrained(path)` as the pair was built (attention, eager experts) and what it reported wrong."""
    kwargs = {"experts_implementation": "eager"} if pair.entry.is_moe else {}
    model, info = cls.from_pretrained(path, output_loading_info=True, attn_implementation=pair.attn, **kwargs)
    return model, {key: f"{len(value)}: {sorted(map(str, value))[:3]}" for key, value in info.items() if value}


def _same_model(
    scenario: str, source: Any, loaded: Any, reference: Any, problems: dict, batch: dict, mismatches: Mismatches
) -> None:
    """`loaded` holds exactly `source`'s weights and computes exactly what `reference` (upstream's class loading
    upstream's own save) computes: a load-time conversion may leave weights with other strides than the saved
    model's, which moves logits in the last bits, upstream's own round trip included."""
    if problems:
        mismatches.found.append(f"{scenario}: loading reported {problems}")
    if type(loaded).__name__ != type(source).__name__:
        mismatches.found.append(f"{scenario}: loaded a {type(loaded).__name__}, saved a {type(source).__name__}")
    expected, got = source.state_dict(), loaded.state_dict()
    if expected.keys() != got.keys():
        mismatches.found.append(f"{scenario}: state dict keys differ: {sorted(expected.keys() ^ got.keys())[:5]}")
        return
    for name, value in expected.items():
        mismatches.check(scenario, name, value, got[name])
    with torch.no_grad():
        mismatches.check(scenario, "logits", reference.eval()(**batch).logits, loaded.eval()(**batch).logits)


def _reverted(model: Any, transform: Any, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model._weight_conversions = [transform]  # what revert_weight_conversion reverses (a loaded model's record)
    try:
        return revert_weight_conversion(model, dict(canonical))
    finally:
        del model._weight_conversions


def _always(transform: Any) -> Any:
    """The transform with its shape-checked ops (`check_dims`: convert only when the checkpoint's shape is not the
    model's) made unconditional: reversed, they write the other layout instead of nothing."""
    transform = copy.deepcopy(transform)
    for op in getattr(transform, "operations", ()):
        if getattr(op, "check_dims", False):
            op.check_dims = False
    return transform


def legacy_layouts(model: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every checkpoint layout (a state dict) the model's own loading conversions accept, one per transform that
    changes something: transformers' reverse of that transform alone applied to the model's state dict.

    A shape-checked transform (VL-MoE's transposed experts) reverses to nothing on save, because the model's layout
    passes its check; its legacy layout is the unconditional reverse, for the tensors whose shape it changes (a
    square tensor's two layouts cannot be told apart by shape, by upstream either, so it keeps the model's)."""
    canonical = model.state_dict()
    layouts = {}
    for transform in get_model_conversion_mapping(model, add_legacy=True):
        state = _reverted(model, transform, canonical)
        if state.keys() == canonical.keys() and all(torch.equal(state[k], v) for k, v in canonical.items()):
            state = _reverted(model, _always(transform), canonical)
            state = {
                k: canonical[k] if k in canonical and v.shape == canonical[k].shape else v for k, v in state.items()
            }
        if state.keys() != canonical.keys() or any(not torch.equal(state[k], v) for k, v in canonical.items()):
            layouts[repr(transform)] = {k: v.contiguous() for k, v in state.items()}
    return layouts


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fidelity_checkpoints")


@pytest.mark.parametrize("model_type", MODELS)
def test_save_load_both_ways(model_type: str, pairs, tmp_module: Path) -> None:
    pair = pairs(model_type)
    upstream_cls, generated_cls = pair.entry.upstream_class(), pair.entry.model_class()
    batch = {
        k: v for k, v in ragged_batch(pair, 2, "left", image="image" in kinds(model_type)).items() if k != "labels"
    }
    mismatches = Mismatches(model_type)
    saved = {}
    for name, model in (("generated", pair.generated), ("upstream", pair.upstream)):
        path = tmp_module / f"{model_type}-{name}"
        model.save_pretrained(path)
        saved[name] = load_file(path / "model.safetensors")
    if saved["generated"].keys() != saved["upstream"].keys():
        mismatches.found.append(
            f"saved keys differ: {sorted(saved['generated'].keys() ^ saved['upstream'].keys())[:5]}"
        )
    else:
        for key, value in saved["upstream"].items():
            mismatches.check("save_pretrained files", key, value, saved["generated"][key])
    reference, _ = _load(upstream_cls, tmp_module / f"{model_type}-upstream", pair)
    loaded, problems = _load(upstream_cls, tmp_module / f"{model_type}-generated", pair)
    _same_model("generated -> upstream", pair.generated, loaded, reference, problems, batch, mismatches)
    loaded, problems = _load(generated_cls, tmp_module / f"{model_type}-upstream", pair)
    if type(loaded).__module__ != pair.entry.module:
        mismatches.found.append(f"upstream -> generated: loaded {type(loaded).__module__}")
    _same_model("upstream -> generated", pair.upstream, loaded, reference, problems, batch, mismatches)
    mismatches.assert_none()


@pytest.mark.parametrize("model_type", MODELS)
def test_every_legacy_layout_loads_into_both(model_type: str, pairs, tmp_module: Path) -> None:
    pair = pairs(model_type)
    layouts = legacy_layouts(pair.upstream)
    if get_model_conversion_mapping(pair.upstream, add_legacy=False):
        assert layouts, f"{model_type}: upstream converts checkpoints on load, but no legacy layout was derived"
    batch = {
        k: v for k, v in ragged_batch(pair, 2, "left", image="image" in kinds(model_type)).items() if k != "labels"
    }
    mismatches = Mismatches(model_type)
    for index, (transform, state) in enumerate(layouts.items()):
        path = tmp_module / f"{model_type}-legacy-{index}"
        pair.upstream.config.save_pretrained(path)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        loaded, reported = {}, {}
        for name, cls in (("upstream", pair.entry.upstream_class()), ("generated", pair.entry.model_class())):
            loaded[name], reported[name] = _load(cls, path, pair)
        if reported["upstream"]:
            # upstream itself does not load this derived layout (transformers 5.23.0's `thinker.`-prefixed omni
            # checkpoints, under `patchgen upgrade --verify`): not a layout it accepts; generated must fail alike
            if reported["generated"] != reported["upstream"]:
                mismatches.found.append(
                    f"{transform}: upstream reported {reported['upstream']}, generated {reported['generated']}"
                )
            continue
        for name in ("upstream", "generated"):
            if reported[name]:
                mismatches.found.append(f"{transform} -> {name}: loading reported {reported[name]}")
            for key, value in pair.upstream.state_dict().items():
                mismatches.check(f"{transform} -> {name}", key, value, loaded[name].state_dict().get(key))
        # the loaded models against each other: a conversion may leave a weight with other strides than the saved
        # model's (upstream too: logits ~1e-8 off the saved model's), but generated must load exactly as upstream
        with torch.no_grad():
            logits = [loaded[name].eval()(**batch).logits for name in ("upstream", "generated")]
        mismatches.check(f"{transform}", "logits of the loaded models", *logits)
    mismatches.assert_none()
