"""Each processor spec's generated processor against upstream's class (built without its video processor, as the
data pipeline builds ours): the same outputs for a call upstream accepts, and the patched calls (an alias, empty
lists) equal to upstream's call without them. Parametrized by spec name, so `patchgen upgrade --verify` counts it
as that spec's proof."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

# spec -> (its generated module, the class): `upgrade --verify --verify-model <processor spec>` regenerates no model
# spec, so neither the class nor the thinker's tiny sizes (below) are read from the model registry
PROCESSOR_SPECS = {
    "qwen3_omni_moe_processor": ("generated.qwen3_omni_moe.processing_qwen3_omni_moe", "Qwen3OmniMoeProcessor"),
}
TINY_SIZES = {
    "vision_config": {"patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2},
    "audio_config": {"num_mel_bins": 16},
}


def _upstream_like(generated, class_name: str):
    """Upstream's processor class with the generated one's sub-processors (no video processor)."""
    import types

    from runtime.data.vision.processor import _image_only

    cls = _image_only(class_name)
    processor = cls(
        image_processor=generated.image_processor,
        video_processor=None,
        feature_extractor=generated.feature_extractor,
        tokenizer=generated.tokenizer,
        chat_template=generated.chat_template,
    )
    # upstream reads the video processor's merge size even without videos (the spec's fallback patch is why ours
    # does not): the image processor's, which the data pipeline feeds video frames through
    processor.video_processor = types.SimpleNamespace(merge_size=generated.image_processor.merge_size)
    return processor


@pytest.mark.parametrize("spec", sorted(PROCESSOR_SPECS))
def test_generated_processor_equals_upstream(spec: str, tmp_path: Path) -> None:
    from PIL import Image

    from runtime.data.audio.processor import build_omni_test_processor, load_omni_processor

    module, name = PROCESSOR_SPECS[spec]
    cls = getattr(importlib.import_module(module), name)
    generated = load_omni_processor(build_omni_test_processor(tmp_path / "proc", tiny=TINY_SIZES), cls=cls)
    assert type(generated).__module__.startswith("generated."), type(generated).__module__
    upstream = _upstream_like(generated, name)
    rng = np.random.default_rng(0)
    wave = rng.standard_normal(16000).astype(np.float32) * 0.1
    image = Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8))
    text = "hi <|vision_start|><|image_pad|><|vision_end|> and <|audio_start|><|audio_pad|><|audio_end|> there"
    ref = upstream(text=[text], images=[image], audio=[wave], return_tensors="pt")
    for got in (
        generated(text=[text], images=[image], audio=[wave], return_tensors="pt"),  # upstream's own call
        generated(text=[text], images=[image], audios=[wave], videos=[], return_tensors="pt"),  # alias, empty list
    ):
        assert ref.keys() == got.keys()
        for key in ref:
            assert torch.equal(ref[key], got[key]), key
