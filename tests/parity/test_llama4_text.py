"""Llama 4's text model: position-dependent attention under SP. Its RoPE layers attend in chunks of
``attention_chunk_size`` tokens, its NoPE layers scale each query by the token's absolute position (temperature
tuning, in steps of ``floor_scale``); the row here is longer than both, packed (two documents, one crossing a chunk
boundary) and odd (SP pads it). Parallelism off: logits, loss and every gradient bitwise equal to upstream. Ulysses
SP = 2, a ring of 2 and Ulysses 2 x ring 2: within the rounding model of one process (``tests.tolerance``). The same
runs with ``sp/global_token_positions`` rendering its expression unchanged (each rank's temperature positions
restart at 0) fail that comparison, so the kind is what makes them pass. The ring's mask of a chunked layer (each
document cut at chunk boundaries) equals transformers' chunked mask of the row."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers

from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import tiny_config
from tests.dist_utils import run_distributed
from tests.parity.dense import grads, packed_batch
from tests.tolerance import assert_within_rounding

MODEL = "llama4_text"
LENGTHS = (13, 10)  # 23 tokens: past the chunk (8) and the temperature step (4); odd, so SP pads the row
CLASS = "Llama4ForCausalLM"
REPO = Path(__file__).resolve().parents[2]
PLANTED = "generated/planted_llama4/modeling_llama4.py"


def _models(model_class: type | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(upstream, generated) with the same random weights; ``model_class``: another generated class (planted)."""
    config = tiny_config(MODEL)
    torch.manual_seed(0)
    upstream = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    generated = (model_class or causal_lm_class(MODEL))(config)
    generated.load_state_dict(upstream.state_dict())
    return upstream, generated


def _run(model: torch.nn.Module, batch: dict) -> dict:
    out = model(**batch)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads(model)}


def test_the_tiny_config_reaches_every_threshold() -> None:
    """Both kinds of layer, temperature tuning on, and a row longer than the chunk and the temperature step."""
    config = tiny_config(MODEL)
    assert sorted(set(config.no_rope_layers)) == [0, 1] and config.attn_temperature_tuning
    assert sorted(set(config.layer_types)) == ["chunked_attention", "full_attention"]
    assert max(config.attention_chunk_size, config.floor_scale) < min(sum(LENGTHS), LENGTHS[0])


def test_parallelism_off_is_bitwise_upstream() -> None:
    upstream, generated = _models()
    ref, got = _run(upstream, packed_batch(LENGTHS)), _run(generated, packed_batch(LENGTHS))
    assert torch.equal(got["loss"], ref["loss"]) and torch.equal(got["logits"], ref["logits"])
    assert got["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert torch.equal(got["grads"][name], grad), name


@pytest.mark.parametrize("documents", [True, False], ids=["packed", "no_position_ids"])
def test_the_ring_masks_chunks_as_transformers_does(documents: bool) -> None:
    """The ring's "may attend" (same segment, causal: ``runtime.sp.usp.segment_ids``) equals transformers' chunked
    mask of the packed row (chunks counted from the row's first token, documents apart when the builder sees the
    position ids), and differs from the unchunked one: the row crosses chunk boundaries inside a document."""
    from transformers.masking_utils import create_chunked_causal_mask

    from runtime.sp.positions import RingMask
    from runtime.sp.usp import segment_ids

    config = tiny_config(MODEL)
    position_ids = packed_batch(LENGTHS)["position_ids"]
    length = position_ids.shape[1]
    upstream = create_chunked_causal_mask(
        config=config,
        inputs_embeds=torch.zeros(1, length, 4),
        attention_mask=None,
        past_key_values=None,
        position_ids=position_ids if documents else None,
    )
    causal = torch.ones(length, length, dtype=torch.bool).tril()

    def ring(chunk: int | None) -> torch.Tensor:
        segments = segment_ids(position_ids, RingMask(documents=documents, chunk=chunk))
        same = (
            torch.ones(1, length, length, dtype=torch.bool)
            if segments is None
            else segments[:, :, None] == segments[:, None, :]
        )
        return (same & causal)[:, None]

    assert torch.equal(ring(config.attention_chunk_size), upstream)
    assert not torch.equal(ring(None), upstream)


def _load_class(path: str | None) -> type | None:
    if path is None:
        return None
    name = f"patchgen_planted_llama4_{Path(path).parents[2].name}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return getattr(sys.modules[name], CLASS)


def sp_worker(rank: int, world: int, cases: list[tuple[int, int, str | None]]) -> list[dict]:
    """Each (sp, ring, module path) case: loss, logits gathered in the row's order, gradients summed over SP."""
    import torch.distributed as dist

    from runtime.data.sp_batch import shard_for_sp
    from runtime.parallel.collectives import gather_along_dim
    from runtime.parallel.state import init_parallel_state, set_parallel_state
    from runtime.sp.layout import to_natural_order

    results = []
    for sp, ring, path in cases:
        state = init_parallel_state(sp_size=sp, ring_size=ring)
        _, model = _models(_load_class(path))
        got = _run(model, shard_for_sp(packed_batch(LENGTHS), state))
        for g in got["grads"].values():  # each rank's gradient is partial: the true one is the sum over SP
            dist.all_reduce(g, group=state.sp_group)
        logits = to_natural_order(gather_along_dim(got["logits"], 1, state.sp_group), 1, sp, ring)
        results.append({**got, "logits": logits[:, : sum(LENGTHS)]})
        set_parallel_state(None)
    return results


def _references() -> tuple[dict, dict]:
    _, model = _models()
    _, truth = _models()
    return _run(model, packed_batch(LENGTHS)), _run(truth.double(), packed_batch(LENGTHS))


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shipped spec regenerated in a temporary project whose sp/global_token_positions renders its expression
    unchanged: each SP rank numbers its own tokens from 0."""
    root = tmp_path_factory.mktemp("no_global_positions")
    from patchgen.config import load_config
    from patchgen.project import regen
    from patchgen.spec_set import load_specs

    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(REPO / "templates", root / "templates")
    template = root / "templates" / "sp" / "global_token_positions.py.j2"
    template.write_text(template.read_text().split("#}\n", 1)[0] + "#}\n{{ expr }}\n")
    (root / "specs").mkdir()
    spec = (REPO / "specs" / f"{MODEL}.toml").read_text()
    (root / "specs" / f"{MODEL}.toml").write_text(re.sub(r'output = "[^"]*"', f'output = "{PLANTED}"', spec, count=1))
    config = load_config(root)
    regen(config, load_specs(config, [MODEL]))
    path = root / PLANTED
    assert "global_token_positions(torch.arange" not in path.read_text()
    return str(path)


# (sp, ring): Ulysses, a ring, both
LAYOUTS = {2: [(2, 1), (2, 2)], 4: [(4, 2)]}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_sp_and_ring_match_one_process(world: int, planted: str) -> None:
    """Every layout within the rounding model; at world 2 the same layouts without the kind fail the comparison."""
    cases = [(sp, ring, None) for sp, ring in LAYOUTS[world]]
    if world == 2:
        cases += [(sp, ring, planted) for sp, ring in LAYOUTS[world]]
    per_rank = run_distributed(sp_worker, world, cases, timeout=300)
    ref, truth = _references()
    for index, (sp, ring, path) in enumerate(cases):
        for rank, results in enumerate(per_rank):
            what = f"{MODEL} sp {sp} ring {ring} rank {rank}" + (" without global positions" if path else "")
            if path is None:
                assert_within_rounding(results[index], ref, truth, what=what)
            else:
                with pytest.raises(AssertionError, match="outside the rounding model"):
                    assert_within_rounding(results[index], ref, truth, what=what)
