"""A run asks only for what its generated class declares (``runtime/models/supports.py``), checked at start-up.

A DiT spec without SP patches used to train at ``parallel.sp: 2`` with every gradient exactly doubled (each SP rank
ran the whole model; the data-parallel reduction added the identical gradients), with exit 0. The record patchgen
derives from the applied patches now says what the class supports, and the launcher refuses the rest in one line.
"""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config.errors import ConfigError
from runtime.models import registry
from runtime.models.registry import Supports
from runtime.models.supports import layout_problems, option_problems
from runtime.train.config import parse_config
from runtime.train.preflight import check_before_launch, check_supported
from tests.train.common import run_config
from tests.train.dit_common import dit_config


def _declaring(monkeypatch: pytest.MonkeyPatch, model_type: str, **supports) -> None:
    entry = registry.REGISTRY[model_type]
    declared = dataclasses.replace(entry.supports, **supports)
    monkeypatch.setitem(registry.REGISTRY, model_type, dataclasses.replace(entry, supports=declared))


def test_shipped_records_declare_what_their_patches_give() -> None:
    flux, qwen3_moe = registry.lookup("flux").supports, registry.lookup("qwen3_moe").supports
    assert flux.sp and flux.ring and not flux.ep and flux.attention_sites == ("FluxAttnProcessor.__call__",)
    assert qwen3_moe.sp and qwen3_moe.ring and qwen3_moe.ep


def test_a_dit_without_sp_patches_is_refused_at_sp_2(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    files = {"flux": save_tiny_pipeline("flux", tmp_path / "flux"), "images": tmp_path / "x", "root": tmp_path}
    config = parse_config(dit_config(files, "flux", tmp_path, parallel={"sp": 2}))
    check_supported(config)  # the shipped flux spec shards tokens and wraps its attention
    _declaring(monkeypatch, "flux", sp=False, ring=False, attention_sites=())  # a shell-only spec
    with pytest.raises(ConfigError) as refused:
        check_before_launch(config, exports=False)  # the launcher's check, before any rank starts
    assert str(refused.value).startswith("parallel.sp: 2 asks for sequence parallelism, but spec 'flux' applies")
    assert "every gradient would be counted 2 times" in str(refused.value)


def test_every_undeclared_dim_is_named_at_once() -> None:
    entry = dataclasses.replace(registry.lookup("qwen3"), supports=Supports())
    problems = layout_problems(entry, sp=4, ring=2, ep=2)
    assert [p.split(":")[0] for p in problems] == ["parallel.sp", "parallel.ep"]  # no ring without SP at all
    entry = dataclasses.replace(registry.lookup("flux"), supports=Supports(sp=True))
    assert [p.split(":")[0] for p in layout_problems(entry, sp=4, ring=2, ep=1)] == ["parallel.ring"]


def test_an_option_the_patched_code_drops_is_refused_unless_handled(tmp_path, monkeypatch) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "qwen3", "final_logit_softcapping": 3.0}')
    raw = run_config(tmp_path, model={"type": "qwen3", "path": str(checkpoint), "config": {}})
    with pytest.raises(ConfigError, match=r"ckpt/config.json: final_logit_softcapping = 3.0 is not honoured by spec"):
        check_supported(parse_config(raw))
    _declaring(monkeypatch, "qwen3", handles=("final_logit_softcapping",))
    check_supported(parse_config(raw))


def test_a_logit_softcap_is_refused_under_a_ring_only() -> None:
    entry = registry.lookup("qwen3")
    values = {"text_config": {"attn_logit_softcapping": 50.0}}
    assert option_problems(entry, values, ring=1, where="model.config") == []
    (problem,) = option_problems(entry, values, ring=2, where="model.config")
    assert problem.startswith("model.config: text_config.attn_logit_softcapping = 50.0 is not honoured")
    assert problem.endswith("or with parallel.ring: 1")
