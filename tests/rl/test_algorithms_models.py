"""Every algorithm beyond Flow-GRPO on every generated DiT the RL job supports besides Flux (whose runs are in
``test_algorithms.py`` and ``test_algorithms_nft_dpo.py``): one checked iteration each (LoRA; the policy moved,
every loss finite), a bitwise resume per algorithm on one of these DiTs (a different one each), and CogVideoX
refused for each algorithm; Diffusion-DPO on the other image DiTs (its video pairs: ``test_dpo_video.py``).
Flow-GRPO itself runs on every DiT in ``test_job.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl.common import assert_resume_is_bitwise, for_algorithm, rl_config, tiny_run

OTHER_DITS = ("wan", "qwenimage", "sd3", "hunyuanvideo")
# each algorithm's cheapest section that still shows what it changes (MixGRPO's window moves every iteration,
# DanceGRPO trains 2 of its 3 eligible steps)
SECTIONS = {
    "grpo_guard": {},
    "mixgrpo": {"iters_per_group": 1},
    "dancegrpo": {"timestep_fraction": 0.67},
    "diffusionnft": {},
}
RESUMED_ON = {"grpo_guard": "wan", "mixgrpo": "qwenimage", "dancegrpo": "sd3", "diffusionnft": "hunyuanvideo"}


def _raw(name: str, model: str, tiny_pipelines, tmp_path: Path) -> dict:
    return for_algorithm(rl_config(model, tiny_pipelines(model), tmp_path), name, **SECTIONS[name])


@pytest.mark.parametrize("model", OTHER_DITS)
@pytest.mark.parametrize("name", list(SECTIONS))
def test_algorithm_trains_on_every_dit(name: str, model: str, tiny_pipelines, tmp_path: Path) -> None:
    metrics, _ = tiny_run(_raw(name, model, tiny_pipelines, tmp_path), iterations=1)
    if name != "diffusionnft":  # the log-prob algorithms: the first inner step recomputes the rollout's log-probs
        assert metrics[0]["logprob_gap_max"] <= 1e-6, metrics[0]["logprob_gap_max"]


@pytest.mark.parametrize("name", list(RESUMED_ON))
def test_resume_is_bitwise_off_flux(name: str, tiny_pipelines, tmp_path: Path) -> None:
    model = RESUMED_ON[name]
    assert_resume_is_bitwise(_raw(name, model, tiny_pipelines, tmp_path), tmp_path / "ckpt")


IMAGE_DITS = ("qwenimage", "sd3")  # Diffusion-DPO here: the image DiTs besides Flux (video pairs: test_dpo_video.py)


def _dpo_raw(model: str, tiny_pipelines, tmp_path: Path) -> dict:
    """``test_dpo``'s run (4 random pairs, 2 per iteration, LoRA) on ``model``."""
    from tests.rl.test_dpo import write_pairs

    raw = rl_config(model, tiny_pipelines(model), tmp_path, optim={"lr": 1e-2})
    for key in ("flowgrpo", "rewards"):
        raw.pop(key)
    raw["data"] = {"pairs": str(write_pairs(tmp_path / "pairs")), "prompts_per_step": 2}
    raw["sampling"].pop("true_cfg_scale", None)  # dpo trains the conditional prediction
    return {**raw, "algorithm": "dpo", "dpo": {"beta": 500.0}}


@pytest.mark.parametrize("model", IMAGE_DITS)
def test_dpo_trains_on_the_other_image_dits(model: str, tiny_pipelines, tmp_path: Path) -> None:
    tiny_run(_dpo_raw(model, tiny_pipelines, tmp_path), iterations=1)


def test_dpo_resume_is_bitwise_off_flux(tiny_pipelines, tmp_path: Path) -> None:
    assert_resume_is_bitwise(_dpo_raw("sd3", tiny_pipelines, tmp_path), tmp_path / "ckpt")


def test_cogvideox_is_refused_for_every_algorithm(tiny_pipelines, tmp_path: Path) -> None:
    """CogVideoX predicts v in the DDPM sense, not a flow velocity: each algorithm's run stops at its checks (before
    the model is built) on an error that names model.type."""
    from runtime.config.errors import ConfigError
    from runtime.parallel.state import set_parallel_state
    from tests.rl.common import start

    for name in SECTIONS:
        raw = _raw(name, "flux", tiny_pipelines, tmp_path)
        raw["model"] = {**raw["model"], "type": "cogvideox"}
        with pytest.raises(ConfigError, match=r"^model\.type: 'cogvideox' is a v-prediction diffusion model"):
            try:
                start(raw)
            finally:
                set_parallel_state(None)
