import sys
from types import SimpleNamespace

import pytest

from runtime.flowgrpo.vllm_omni import VllmOmniRollout, build_requests, parse_outputs, vllm_omni_available


def test_module_does_not_import_vllm_omni():
    assert "vllm_omni" not in sys.modules or vllm_omni_available()[0]


def test_build_requests_one_per_sample_with_own_seed():
    reqs = build_requests(
        ["a", "b"], group_size=3, seeds=range(10, 16), num_inference_steps=8, guidance_scale=4.5, height=64, width=32
    )
    assert [r.prompt for r in reqs] == ["a"] * 3 + ["b"] * 3
    assert [r.sampling["seed"] for r in reqs] == list(range(10, 16))
    assert reqs[0].sampling == {"num_inference_steps": 8, "guidance_scale": 4.5, "seed": 10, "height": 64, "width": 32}
    with pytest.raises(ValueError, match="one seed per sample"):
        build_requests(["a"], group_size=2, seeds=[1], num_inference_steps=1, guidance_scale=1, height=8, width=8)


def test_parse_outputs_documented_shape():
    outs = [SimpleNamespace(request_output=SimpleNamespace(images=[f"img{i}"])) for i in range(3)]
    assert parse_outputs(outs, 3) == ["img0", "img1", "img2"]
    with pytest.raises(ValueError, match="2 outputs for 3"):
        parse_outputs(outs[:2], 3)
    with pytest.raises(ValueError, match="no images"):
        parse_outputs([SimpleNamespace(request_output=SimpleNamespace(images=[]))], 1)


def test_rollout_without_trajectory_is_refused():
    r = VllmOmniRollout(engine=object())
    with pytest.raises(NotImplementedError, match="images only"):
        r.rollout(["a"], group_size=1, seeds=[0], num_inference_steps=2, schedule=None)


def test_real_engine_generates_images():
    ok, reason = vllm_omni_available()
    if not ok:
        pytest.skip(f"vllm-omni engine test needs an importable vllm_omni (CUDA torch build): {reason}")
    pytest.skip("no model weights are available offline to start an Omni engine with")  # pragma: no cover
