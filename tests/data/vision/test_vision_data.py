"""The VLM data pipeline: JSONL media parts, the tiny processor, tokenization with labels and M-RoPE ids, packing,
the loader and the SP collator, on a synthetic data set and tiny generated qwen3_vl / qwen2_5_vl models."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.utils import is_torchvision_available
from transformers.video_utils import VideoMetadata

from runtime.data.sampler import Order
from runtime.data.samples import ChatMessage, ChatSample, ImagePart, TextPart, TextSample, VideoPart, read_jsonl
from runtime.data.sp_batch import pad_to_multiple, shard_for_sp, shard_row
from runtime.data.text.tokenization import IM_END, tokenize_sample
from runtime.data.vision.packing import MultimodalPackedLoader, pack_multimodal_row
from runtime.data.vision.processor import build_test_processor, load_processor, vlm_token_ids
from runtime.data.vision.synthetic import write_synthetic_vlm_dataset
from runtime.data.vision.tokenization import VISION_KEYS, MultimodalSample, tokenize_multimodal
from runtime.data.vision.video import video_inputs, video_replacement
from runtime.models.registry import causal_lm_class, lookup
from runtime.models.tiny_configs import tiny_config
from runtime.parallel.state import ParallelState
from tests.parity.test_vlm_sp import shard as reference_shard

MERGE = 2  # TINY_VISION spatial_merge_size


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {t: load_processor(build_test_processor(tmp_path_factory.mktemp(t), t)) for t in ("qwen3_vl", "qwen2_5_vl")}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> list[ChatSample]:
    """Sample 0: one image, 1: a 4-frame video, 2: two images, 3..: one image (see synthetic_vlm)."""
    return read_jsonl(write_synthetic_vlm_dataset(tmp_path_factory.mktemp("vlm_data"), 8, seed=0))


def tiny_model(model_type: str, processor):
    config = tiny_config(model_type, **vlm_token_ids(processor), text_config={"vocab_size": len(processor.tokenizer)})
    torch.manual_seed(0)
    return causal_lm_class(model_type)(config)


def rope_ids(model):
    """The position-id function of a model: the first value of its get_rope_index (until the generated classes'
    get_position_id_func hook is everywhere)."""
    get_rope_index = functools.partial(type(model.model).get_rope_index, model.model)

    def fn(input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None, **extra):
        return get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, **extra)[0]

    return fn


@pytest.fixture(scope="module")
def qwen3(processors) -> SimpleNamespace:
    processor = processors["qwen3_vl"]
    model = tiny_model("qwen3_vl", processor)
    return SimpleNamespace(processor=processor, model=model, rope=rope_ids(model))


@pytest.fixture(scope="module")
def tokenized(qwen3, dataset) -> list[MultimodalSample]:
    return [tokenize_multimodal(s, qwen3.processor, qwen3.rope) for s in dataset]


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of True."""
    edges = torch.diff(torch.cat([torch.tensor([0]), mask.int(), torch.tensor([0])])).tolist()
    starts = [i for i, e in enumerate(edges) if e == 1]
    ends = [i for i, e in enumerate(edges) if e == -1]
    return list(zip(starts, ends, strict=True))


def trained_text(processor, sample: MultimodalSample) -> list[str]:
    assert torch.equal(sample.labels[sample.labels != -100], sample.input_ids[sample.labels != -100])
    return [processor.tokenizer.decode(sample.input_ids[a:b]) for a, b in runs(sample.labels != -100)]


# --- JSONL ---------------------------------------------------------------------------------------------------------


def test_jsonl_reads_media_parts_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("sub/a.png", "f0.png", "f1.png"):
        Image.new("RGB", (16, 16)).save(tmp_path / name)
    absolute = tmp_path / "f1.png"
    content = [
        {"type": "text", "text": "Look: "},
        {"type": "image", "image": "sub/a.png"},
        {"type": "video", "video": ["f0.png", str(absolute)], "fps": 4},
    ]
    line = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Seen."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: messages\[0\].content\[2\].video\[1\]: absolute path"):
        read_jsonl(tmp_path / "d.jsonl")  # media paths are relative to the data file
    (sample,) = read_jsonl(tmp_path / "d.jsonl", media_dir=tmp_path)  # absolute ones inside an explicit media_dir
    user = ChatMessage(
        "user",
        (TextPart("Look: "), ImagePart(tmp_path / "sub/a.png"), VideoPart((tmp_path / "f0.png", absolute), 4.0)),
    )
    assert sample == ChatSample((user, ChatMessage("assistant", "Seen.")))
    assert sample.is_multimodal and user.text == "Look: "


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"type": "image", "image": "missing.png"}, "messages[0].content[1].image: file not found: {dir}/missing.png"),
        ({"type": "video", "video": ["ok.png", "gone.png"]}, "content[1].video[1]: file not found: {dir}/gone.png"),
        ({"type": "sound", "sound": "x.wav"}, "messages[0].content[1].type must be one of text, image, video, audio"),
        ({"type": "audio", "audio": "x.wav"}, "messages[0].content[1].audio: file not found: {dir}/x.wav"),
        ({"type": "video", "video": ["ok.png"], "audio": "t.wav"}, "content[1].audio: file not found: {dir}/t.wav"),
        ({"type": "video", "video": []}, "content[1].video must be a non-empty list of frame image paths"),
        ({"type": "video", "video": ["ok.png"], "fps": 0}, "content[1].fps must be a positive number"),
        ({"type": "text"}, "content[1].text must be a string"),
        ("just a string", "content[1] must be an object with a 'type', got str"),
    ],
)
def test_bad_media_part_names_file_line_and_what(tmp_path: Path, part, expected: str) -> None:
    Image.new("RGB", (16, 16)).save(tmp_path / "ok.png")
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Q"}, part]},
            {"role": "assistant", "content": "A"},
        ]
    }
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError) as info:
        read_jsonl(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert expected.format(dir=tmp_path) in str(info.value)


def test_unreadable_image_names_the_file(tmp_path: Path, qwen3) -> None:
    broken = tmp_path / "broken.png"
    broken.write_text("not a png")
    chat = ChatSample((ChatMessage("user", (ImagePart(broken),)), ChatMessage("assistant", "?")))
    with pytest.raises(ValueError, match=f"cannot read image {broken}"):
        tokenize_multimodal(chat, qwen3.processor, qwen3.rope)


def test_text_pipeline_refuses_media_but_takes_text_parts(tokenizer, dataset) -> None:
    with pytest.raises(ValueError, match="processor"):
        tokenize_sample(dataset[0], tokenizer)
    parts = ChatSample((ChatMessage("user", (TextPart("Hi"),)), ChatMessage("assistant", "Hello there.")))
    plain = ChatSample((ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello there.")))
    assert tokenize_sample(parts, tokenizer) == tokenize_sample(plain, tokenizer)


# --- processor -----------------------------------------------------------------------------------------------------


def test_test_processor_is_a_qwen_processor_with_tiny_vision_sizes(processors, tmp_path: Path) -> None:
    for model_type, cls in (("qwen3_vl", Qwen3VLProcessor), ("qwen2_5_vl", Qwen2_5_VLProcessor)):
        processor = processors[model_type]
        assert isinstance(processor, cls)
        ids = vlm_token_ids(processor)
        assert len(set(ids.values())) == 4 and max(ids.values()) < len(processor.tokenizer) <= 1024
        image = processor.image_processor
        assert (image.patch_size, image.temporal_patch_size, image.merge_size) == (4, 2, 2)
        assert processor.tokenizer.convert_tokens_to_ids(IM_END) is not None and processor.chat_template
    with pytest.raises(FileNotFoundError):
        load_processor(tmp_path / "nope")
    with pytest.raises(ValueError, match="model_type"):
        build_test_processor(tmp_path, "llama")


@pytest.mark.skipif(
    not is_torchvision_available(),
    reason="transformers 5.14.1 builds Qwen-VL processors (their video processors) only with torchvision",
)
def test_auto_processor_round_trip(tmp_path: Path, processors) -> None:
    from transformers import AutoProcessor

    loaded = AutoProcessor.from_pretrained(build_test_processor(tmp_path, "qwen3_vl"))
    assert type(loaded).__name__ == "Qwen3VLProcessor"
    assert vlm_token_ids(loaded) == vlm_token_ids(processors["qwen3_vl"])


# --- tokenization --------------------------------------------------------------------------------------------------


def test_two_image_sample(qwen3, dataset, tokenized) -> None:
    processor, sample = qwen3.processor, tokenized[2]
    ids = vlm_token_ids(processor)
    grids = sample.image_grid_thw
    assert grids.shape == (2, 3) and sample.pixel_values.shape == (int(grids.prod(-1).sum()), 3 * 2 * 4 * 4)
    image_runs = runs(sample.input_ids == ids["image_token_id"])
    assert [b - a for a, b in image_runs] == [int(g.prod()) // MERGE**2 for g in grids]
    for a, b in image_runs:
        assert sample.input_ids[a - 1] == ids["vision_start_token_id"]
        assert sample.input_ids[b] == ids["vision_end_token_id"]
        assert sample.mm_token_type_ids[a:b].eq(1).all()
    assert sample.mm_token_type_ids.dtype == torch.int32
    assert int(sample.mm_token_type_ids.ne(0).sum()) == sum(b - a for a, b in image_runs)
    assert sample.pixel_values_videos is None and sample.second_per_grid_ts is None
    assert trained_text(processor, sample) == [dataset[2].messages[-1].content + IM_END]


def test_labels_cover_only_assistant_text_in_every_sample(qwen3, dataset, tokenized) -> None:
    for chat, sample in zip(dataset, tokenized, strict=True):
        assert trained_text(qwen3.processor, sample) == [chat.messages[-1].content + IM_END]
        assert sample.labels[sample.mm_token_type_ids != 0].eq(-100).all()


def test_multi_turn_labels_and_text_only_chat(qwen3, dataset) -> None:
    image = dataset[0].messages[0].content[0]
    chat = ChatSample(
        (
            ChatMessage("system", "Be brief."),
            ChatMessage("user", (image, TextPart("Colour?"))),
            ChatMessage("assistant", "Purple."),
            ChatMessage("user", (TextPart("And this one?"), image)),
            ChatMessage("assistant", "Also purple."),
        )
    )
    sample = tokenize_multimodal(chat, qwen3.processor, qwen3.rope)
    assert trained_text(qwen3.processor, sample) == ["Purple." + IM_END, "Also purple." + IM_END]
    assert sample.image_grid_thw.shape[0] == 2
    text_only = tokenize_multimodal(
        ChatSample((ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello."))), qwen3.processor, qwen3.rope
    )
    assert all(getattr(text_only, key) is None for key in VISION_KEYS)
    assert torch.equal(text_only.position_ids, torch.arange(len(text_only)).expand(4, -1))
    document = tokenize_multimodal(TextSample("Once upon a time."), qwen3.processor, qwen3.rope)
    assert torch.equal(document.labels, document.input_ids) and document.mm_token_type_ids.eq(0).all()
    assert document.input_ids[-1] == qwen3.processor.tokenizer.eos_token_id


def test_video_sample_patches_and_layout(qwen3, dataset, tokenized) -> None:
    processor, sample, part = qwen3.processor, tokenized[1], dataset[1].messages[0].content[0]
    ids = vlm_token_ids(processor)
    frames = [Image.open(f).convert("RGB") for f in part.frames]
    ((t, h, w),) = sample.video_grid_thw.tolist()
    assert t == len(frames) // 2 and sample.pixel_values_videos.shape == (t * h * w, 96)
    # Each temporal group of 2 frames: columns (channel, frame, patch row, patch col) hold frame 2g + k's patches.
    per_frame = processor.image_processor(images=frames, return_tensors="pt")["pixel_values"]
    per_frame = per_frame.reshape(len(frames), h * w, 3, 2, 4, 4)[:, :, :, 0]
    video = sample.pixel_values_videos.reshape(t, h * w, 3, 2, 4, 4)
    for g in range(t):
        for k in range(2):
            assert torch.equal(video[g, :, :, k], per_frame[2 * g + k])
    frame_runs = runs(sample.input_ids == ids["video_token_id"])
    assert [b - a for a, b in frame_runs] == [h * w // MERGE**2] * t  # one run per temporal group
    text = processor.tokenizer.decode(sample.input_ids)
    assert "<0.2 seconds><|vision_start|><|video_pad|>" in text and "<1.2 seconds>" in text  # fps 2: frames 0-1, 2-3
    assert sample.mm_token_type_ids[sample.input_ids == ids["video_token_id"]].eq(2).all()
    assert sample.second_per_grid_ts is None  # qwen3_vl puts time in the prompt


def test_video_replacement_matches_upstream_processors(processors, dataset) -> None:
    """Our video text equals upstream's replace_video_token (called on a stand-in: its video processor needs
    torchvision here)."""
    frames = [Image.open(f).convert("RGB") for f in dataset[1].messages[0].content[0].frames[:3]]
    for model_type, cls in (("qwen3_vl", Qwen3VLProcessor), ("qwen2_5_vl", Qwen2_5_VLProcessor)):
        processor = processors[model_type]
        clip = video_inputs(processor.image_processor, frames, fps=2.0)
        standin = SimpleNamespace(
            video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
            video_token=processor.video_token,
            vision_start_token="<|vision_start|>",
            vision_end_token="<|vision_end|>",
            _calculate_timestamps=functools.partial(Qwen3VLProcessor._calculate_timestamps, None),
        )
        metadata = VideoMetadata(total_num_frames=3, fps=2.0, frames_indices=[0, 1, 2])
        inputs = {"video_grid_thw": torch.tensor([clip.grid_thw]), "video_metadata": [metadata]}
        assert video_replacement(processor, clip) == cls.replace_video_token(standin, inputs, 0)


def test_image_tokens_equal_the_processor_call(qwen3, dataset, tokenized) -> None:
    """Our expansion and tokenization give exactly what upstream's processor __call__ gives for the same text."""
    processor = qwen3.processor
    chat = dataset[2]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "image"},
                {"type": "text", "text": chat.messages[0].content[-1].text},
            ],
        },
        {"role": "assistant", "content": chat.messages[1].content},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    images = [Image.open(p.path).convert("RGB") for p in chat.messages[0].content[:2]]
    reference = processor(text=[text], images=images, return_tensors="pt")
    assert torch.equal(reference["input_ids"][0], tokenized[2].input_ids)
    assert torch.equal(reference["mm_token_type_ids"][0].int(), tokenized[2].mm_token_type_ids)
    assert torch.equal(reference["pixel_values"], tokenized[2].pixel_values)


def upstream_rope(model_type: str, config):
    """M-RoPE ids from upstream transformers' own model class (not the generated one)."""
    model = lookup(model_type).upstream_auto_class().from_config(config)
    return rope_ids(model)


def test_position_ids_equal_upstream_get_rope_index(qwen3, tokenized) -> None:
    upstream = upstream_rope("qwen3_vl", qwen3.model.config)
    hook = getattr(type(qwen3.model), "get_position_id_func", None)
    for sample in tokenized[:3]:  # image, video, two images
        assert torch.equal(sample.position_ids[0], torch.arange(len(sample)))
        expected = upstream(
            sample.input_ids[None], sample.mm_token_type_ids[None], sample.image_grid_thw, sample.video_grid_thw
        )
        assert torch.equal(sample.position_ids[1:], expected[:, 0])
        assert sample.position_ids[1:].amax() < len(sample) - 1  # vision tokens really share positions
        if hook is not None:  # the generated classes' own hook, once it exists, gives the same ids
            ids = hook(qwen3.model.config)(
                sample.input_ids[None], sample.mm_token_type_ids[None], sample.image_grid_thw, sample.video_grid_thw
            )
            assert torch.equal(ids[:, 0], sample.position_ids[1:])


def test_qwen2_5_vl_tokenizes_images_and_video(processors, dataset) -> None:
    processor = processors["qwen2_5_vl"]
    model = tiny_model("qwen2_5_vl", processor)
    upstream = upstream_rope("qwen2_5_vl", model.config)
    for chat in dataset[:3]:
        sample = tokenize_multimodal(chat, processor, rope_ids(model))
        assert trained_text(processor, sample) == [chat.messages[-1].content + IM_END]
        extra = {} if sample.second_per_grid_ts is None else {"second_per_grid_ts": sample.second_per_grid_ts}
        expected = upstream(
            sample.input_ids[None],
            sample.mm_token_type_ids[None],
            sample.image_grid_thw,
            sample.video_grid_thw,
            **extra,
        )
        assert torch.equal(sample.position_ids[1:], expected[:, 0])
    video = tokenize_multimodal(dataset[1], processor, rope_ids(model))
    assert video.second_per_grid_ts.tolist() == [1.0]  # 2 frames per group at 2 fps
    text = processor.tokenizer.decode(video.input_ids)
    assert "seconds" not in text and text.count("<|vision_start|>") == 1


# --- packing, loader, SP -------------------------------------------------------------------------------------------


def test_packed_row_keeps_samples_and_pixels_in_order(tokenized) -> None:
    samples = [tokenized[0], tokenized[1], tokenized[2]]  # image, video, two images
    row = pack_multimodal_row(samples, 1000)
    length = sum(len(s) for s in samples)
    assert row["input_ids"].shape == row["labels"].shape == row["mm_token_type_ids"].shape == (1, length)
    assert row["position_ids"].shape == (4, 1, length)  # upstream's layout, channels first
    assert torch.equal(row["pixel_values"], torch.cat([tokenized[0].pixel_values, tokenized[2].pixel_values]))
    assert torch.equal(row["image_grid_thw"], torch.cat([tokenized[0].image_grid_thw, tokenized[2].image_grid_thw]))
    assert torch.equal(row["pixel_values_videos"], tokenized[1].pixel_values_videos)
    assert "second_per_grid_ts" not in row
    starts = (row["position_ids"][0, 0] == 0).nonzero().flatten().tolist()
    assert starts == [0, len(samples[0]), len(samples[0]) + len(samples[1])]
    assert row["position_ids"][:, 0, starts].eq(0).all()  # every channel restarts per sample
    assert row["labels"][0, starts].eq(-100).all()
    assert set(pack_multimodal_row([tokenized[0]], 1000)) == {
        "input_ids",
        "labels",
        "mm_token_type_ids",
        "position_ids",
        "pixel_values",
        "image_grid_thw",
    }
    with pytest.raises(ValueError, match="never truncated"):
        pack_multimodal_row(samples, length - 1)


def test_tiny_qwen3_vl_trains_on_a_packed_row(qwen3, tokenized) -> None:
    row = pack_multimodal_row(tokenized[:3], 1000)
    out = qwen3.model(**row)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in qwen3.model.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.visual.") for n in grads) and all(torch.isfinite(g).all() for g in grads.values())
    qwen3.model.zero_grad(set_to_none=True)


def test_loader_drops_over_long_samples_and_resumes(tokenized) -> None:
    budget = max(len(s) for s in tokenized) - 1
    too_long = sum(len(s) > budget for s in tokenized)
    assert too_long >= 1
    loader = MultimodalPackedLoader(tokenized, budget, Order(seed=3))
    assert loader.num_dropped == too_long
    reference = [next(loader) for _ in range(6)]  # crosses into the second epoch
    assert all(b["input_ids"].shape[1] <= budget and b["position_ids"].shape[:2] == (4, 1) for b in reference)
    first = MultimodalPackedLoader(tokenized, budget, Order.for_parallel_state(ParallelState(), seed=3))
    next(first)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = MultimodalPackedLoader(tokenized, budget, Order(seed=3))
    resumed.load_state_dict(state)
    for expected in reference[1:]:
        got = next(resumed)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="fits whole"):
        MultimodalPackedLoader(tokenized, 8)


def test_sp_collator_matches_the_reference_layout(tokenized) -> None:
    samples = next(
        c
        for c in ([tokenized[2], tokenized[1]], [tokenized[2]], [tokenized[0], tokenized[1]])
        if sum(len(s) for s in c) % 2
    )
    row = pack_multimodal_row(samples, 1000)
    length = row["input_ids"].shape[1]
    assert length % 2 == 1
    padded = pad_to_multiple(row, 2)
    assert padded["position_ids"].shape == (4, 1, length + 1) and padded["position_ids"][:, 0, -1].eq(0).all()
    assert padded["labels"][0, -1] == -100 and padded["mm_token_type_ids"][0, -1] == 0
    ranks = [shard_row(row, 2, r) for r in range(2)]
    for rank, local in enumerate(ranks):
        expected = reference_shard(row, 2, rank)
        assert local.keys() == expected.keys()
        for key in expected:
            assert torch.equal(local[key], expected[key]), key
        assert local["pixel_values"] is row["pixel_values"] and local["position_ids"].shape[-1] == length + 1
    for key in ("input_ids", "labels", "mm_token_type_ids"):
        assert torch.equal(torch.cat([r[key] for r in ranks], 1), padded[key])
    single = shard_for_sp(row, ParallelState())  # sp=1: the row itself
    assert all(torch.equal(single[k], row[k]) for k in row)


def test_a_position_id_layout_other_than_upstreams_is_an_error(tokenized) -> None:
    """The pipeline never guesses a layout: batch-first M-RoPE ids (or a wrong dtype) are refused, not transposed."""
    row = pack_multimodal_row([tokenized[0]], 1000)
    for bad in (row["position_ids"].transpose(0, 1), row["position_ids"][1:], row["position_ids"].int()):
        with pytest.raises(ValueError, match=r"channels first"):
            shard_row({**row, "position_ids": bad}, 2, 0)
    with pytest.raises(ValueError, match=r"channels first"):
        shard_row({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.arange(4)}, 2, 0)


def test_text_rows_shard_as_before() -> None:
    ids = torch.arange(1, 8)[None]
    row = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])}
    padded = pad_to_multiple(row, 4)
    assert padded.keys() == row.keys()
    assert padded["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert padded["labels"].tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    local = shard_row(row, 2, 1)
    assert local["input_ids"].tolist() == [[5, 6, 7, 0]] and local["position_ids"].shape == (1, 8)


# --- synthetic data ------------------------------------------------------------------------------------------------


def test_synthetic_dataset_is_deterministic_and_varied(tmp_path: Path, dataset) -> None:
    def digest(jsonl: Path) -> dict[str, str]:
        return {
            p.relative_to(jsonl.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(jsonl.parent.rglob("*"))
            if p.is_file()
        }

    a = digest(write_synthetic_vlm_dataset(tmp_path / "a", 8, seed=0))
    assert a == digest(write_synthetic_vlm_dataset(tmp_path / "b", 8, seed=0))
    assert a != digest(write_synthetic_vlm_dataset(tmp_path / "c", 8, seed=1))
    kinds = [[type(p).__name__ for p in s.messages[0].content if not isinstance(p, TextPart)] for s in dataset]
    assert kinds.count(["VideoPart"]) == 1 and kinds.count(["ImagePart", "ImagePart"]) == 2
    files = [
        path
        for sample in dataset
        for part in sample.messages[0].content
        for path in (
            part.frames if isinstance(part, VideoPart) else [part.path] if isinstance(part, ImagePart) else []
        )
    ]
    assert len(files) == 5 + 2 * 2 + 4  # 5 one-image samples, 2 two-image, 4 frames
    for path in files:
        width, height = Image.open(path).size
        assert width % 8 == 0 and height % 8 == 0 and 16 <= min(width, height) <= max(width, height) <= 32
    assert math.isclose(dataset[1].messages[0].content[0].fps, 2.0)
