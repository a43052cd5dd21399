"""``runtime.rl`` on 2 gloo ranks against one process, per generated DiT (Wan with true CFG, Flux, Qwen-Image with
true CFG), full fine-tuning so every transformer parameter's gradient is compared (Wan also with LoRA):

* Ulysses SP=2: the two SP ranks roll out the same samples (same prompts, seeds, final latents bitwise), the
  recomputed log-probs are within 1e-6 of the rollout's, and the loss, the final latents and every gradient are
  within the rounding model of the single process's (``runtime/rounding.py``: FACTOR x their distance from the same
  run on kernels that sum in other orders, plus a floor of ulps);
* FSDP2 over 2 data-parallel replicas with one prompt each: the loss and every gradient within the rounding model of
  one process taking both prompts (the advantages' global std spans both replicas).

One pooled 2-rank world runs every case (``tests.dist_utils``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed, start_reordered
from tests.rl.common import ACCEPTANCE, MODELS, assert_layout_matches, one_iteration, references, rl_config
from tests.supports import require

FULL = {"rank": None}
GROUPS_OF_3 = {"group_size": 3, "window_size": 2, "adv_clip_max": 0.5}  # clipped advantages of 3 do not sum to 0


def _compare(
    got: dict, ref: dict, witness: dict | list[dict], latents: bool = True, metrics: tuple[str, ...] = ("policy_loss",)
) -> None:
    """The loss, every gradient and (``latents``: the rank holds all the samples) the final latents under the rounding
    model (``assert_layout_matches``). The loss's terms are the advantages (unit std, clipped at ``adv_clip_max``), so
    its floor is ulps of 1, not of the loss, which cancels towards 0; a loss that cancels below what the bound can
    see fails as powerless (the rewards must not give advantages that sum to 0)."""
    if not latents:
        ref = {k: v for k, v in ref.items() if k != "final_latents"}
        witness = [
            {k: v for k, v in w.items() if k != "final_latents"}
            for w in ([witness] if isinstance(witness, dict) else witness)
        ]
    assert_layout_matches(got, ref, witness, metrics, scale={"policy_loss": 1.0})


@pytest.mark.dist
@pytest.mark.parametrize("model", MODELS)
def test_sp2_equals_one_process(model, tiny_pipelines, tmp_path: Path) -> None:
    require(model, "sp")
    raw = rl_config(model, tiny_pipelines(model), tmp_path, lora=FULL, flowgrpo=GROUPS_OF_3)
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert (ranks[0]["final_latents"] == ranks[1]["final_latents"]).all()  # the SP ranks hold the same samples
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] <= 1e-6, got["metrics"]["logprob_gap_max"]
        _compare(got, ref, witness)


@pytest.mark.dist
@pytest.mark.parametrize("model", ACCEPTANCE)
def test_fsdp_two_replicas_equal_one_process(model, tiny_pipelines, tmp_path: Path) -> None:
    # the single process rolls out and trains in the replicas' layout: chunks of one prompt's 3 samples
    layout = {**GROUPS_OF_3, "micro_batch_size": 3}
    raw = rl_config(model, tiny_pipelines(model), tmp_path, lora=FULL, flowgrpo=layout, sampling={"batch_size": 3})
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "data": {**raw["data"], "prompts_per_step": 1}}, timeout=300)
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] == 0.0
        _compare(got, ref, witness, latents=False)


@pytest.mark.dist
def test_sp2_with_lora(tiny_pipelines, tmp_path: Path) -> None:
    """LoRA's gradients at the first step (B = 0, so A gets none) under the rounding model. At B = 0 a LoRA gradient is
    the base weight's gradient projected on the adapter's rank-4 subspace: it keeps the float32 noise of the full
    gradient while shrinking the gradient itself. Worse, under SP the cross-attention's text values (replicated) get
    their gradient as a sum of the two ranks' partial ones, each a sum over that rank's video queries of terms the
    softmax cancels: partials far larger than their sum, whose rounding one process never has (the SP difference
    measured 6x the reordered-kernel witness there). A one-process run whose micro-batches split the samples (its
    gradient accumulated from partial sums likewise) is a second witness; each tensor takes the larger. A's gradients
    are exactly zero on both sides."""
    require("wan", "sp")
    raw = rl_config("wan", tiny_pipelines("wan"), tmp_path, flowgrpo=GROUPS_OF_3)
    ref, witness = references(one_iteration, raw)
    split = start_reordered(one_iteration, {**raw, "flowgrpo": {**raw["flowgrpo"], "micro_batch_size": 2}})()
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert all(".lora_" in n for n in ref["grads"])
    for got in ranks:
        for name, g in ref["grads"].items():
            if ".lora_A" in name:
                assert g.norm() == 0 and got["grads"][name].norm() == 0, name
        _compare(got, ref, [witness, split])


@pytest.mark.dist
def test_rewards_on_one_rank_for_both_replicas(tiny_pipelines, tmp_path: Path) -> None:
    """``reward_ranks: [1]``: rank 1 alone builds the reward and scores both replicas' samples; the rewards and the
    update are those of every rank scoring its own."""
    layout = {**GROUPS_OF_3, "micro_batch_size": 3}
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, lora=FULL, flowgrpo=layout, sampling={"batch_size": 3})
    ref, witness = references(one_iteration, raw)
    two = {**raw, "data": {**raw["data"], "prompts_per_step": 1}, "reward_ranks": [1]}
    for got in run_distributed(one_iteration, 2, two, timeout=300):
        _compare(got, ref, witness, latents=False, metrics=("policy_loss", "reward"))
