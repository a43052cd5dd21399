"""Under SP every attention module passes a checked site in each forward, or the forward raises.

An attention whose code was never patched (a processor class a spec lists but never patched, a layer whose forward
is upstream's) attends to this rank's tokens only: output 3e-2 off and a gradient 107% off, with exit 0. The site
check (``runtime/parallel/sites.py``, installed by ``parallelize`` whenever SP is on) turns that into an error on the
first forward, naming the module.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed


def _qwen3(state) -> str:
    import types

    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from runtime.data.sp_batch import shard_for_sp
    from runtime.models.registry import causal_lm_class
    from runtime.models.tiny_configs import random_packed_batch, tiny_config
    from runtime.parallel.sites import UnpatchedAttentionError, install_site_checks

    config = tiny_config("qwen3")
    model = causal_lm_class("qwen3")(config)
    install_site_checks(model, "parallel.sp = 2", spec="qwen3")
    batch = shard_for_sp(random_packed_batch((9, 7), config.vocab_size), state)
    model(**batch).loss.backward()  # every attention passes the Ulysses site: no error
    attention = model.model.layers[1].self_attn

    def unpatched(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        # upstream's forward, causal without a mask: it runs, on this rank's tokens only (silently wrong)
        return Qwen3Attention.forward(self, hidden_states, position_embeddings, None, **kwargs)

    attention.forward = types.MethodType(unpatched, attention)
    try:
        model(**batch)
    except UnpatchedAttentionError as exc:
        return str(exc)
    return "no error"


def _flux(state) -> str:
    import diffusers.models.transformers.transformer_flux as upstream

    from generated.flux_dit import transformer_flux as generated
    from runtime.parallel.sites import UnpatchedAttentionError, install_site_checks
    from tests.dit.cases import CASES, inputs, loss_and_grads, shell

    case = next(c for name, c in sorted(CASES.items()) if c.model_type == "flux")
    model = shell(case)
    install_site_checks(model, "parallel.sp = 2", spec="flux")
    loss_and_grads(model, inputs(case))  # every processor call passes attention_split: no error
    # the listed processor class with upstream's __call__ (a processor the spec lists but never patched); put back
    # afterwards: the gloo worker processes are pooled, and later tests in this process train the real Flux
    patched = generated.FluxAttnProcessor.__call__
    generated.FluxAttnProcessor.__call__ = upstream.FluxAttnProcessor.__call__
    try:
        loss_and_grads(model, inputs(case))
    except UnpatchedAttentionError as exc:
        return str(exc)
    finally:
        generated.FluxAttnProcessor.__call__ = patched
    return "no error"


def sites_worker(rank: int, world_size: int) -> dict[str, str]:
    import torch

    from runtime.parallel.state import init_parallel_state

    torch.set_num_threads(1)
    state = init_parallel_state(sp_size=world_size)
    return {"qwen3": _qwen3(state), "flux": _flux(state)}


@pytest.mark.dist
def test_an_unpatched_attention_under_sp_is_refused_at_its_first_forward() -> None:
    for result in run_distributed(sites_worker, 2, timeout=300):
        assert result["qwen3"].startswith("model.layers.1.self_attn (Qwen3Attention) ran under parallel.sp = 2")
        assert "mixed this rank's tokens only" in result["qwen3"]
        assert (
            "(FluxAttention) ran under parallel.sp = 2 without passing through a patched attention site"
            in (result["flux"])
        )
