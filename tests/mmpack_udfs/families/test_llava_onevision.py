"""LLaVA-OneVision without Spark: tokens per image against transformers' processor (a sample's only
image in anyres crops, the images of a multi-image sample one crop each), crops against its image
processor, frame sampling, the chat template's media-first turns, what is quarantined (videos
without a fixed frame count, truncation that drops an image of a multi-image sample, a video
written before an image), and the processor options mmpack refuses (exit 2, naming them)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from loader import vision
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from tests.mmpack_udfs.families.test_model_dir import refusal
from tests.models.build import build_model_dir
from tests.oracles import llava_onevision as oracle
from tests.oracles.qwen_family import labels_of, messages

SIZES = [(h, w) for h in (1, 3, 37, 100, 383, 384, 385, 480, 899, 1080, 2304, 3000, 5000) for w in
         (1, 5, 100, 384, 640, 1024, 1920, 2000, 4000)]  # fmt: skip


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The published directory as it is: no video processor config (every frame of a clip)."""
    target = build_model_dir("llava_onevision", tmp_path_factory.mktemp("llava") / "model")
    (target / "video_preprocessor_config.json").unlink()
    return target


def tokenizer_of(directory, *overrides: str, num_frames: int | None = None):
    """The directory's tokenizer; ``num_frames``: its video processor set to sample that many."""
    config = load_run(None, [f"tokenize.model={directory}", "tokenize.max_tokens=100000", *overrides]).config
    if num_frames:
        config.profiles["model"].video.do_sample_frames = True
        config.profiles["model"].video.num_frames = num_frames
    return SampleTokenizer(TokenizeSettings.from_config(config)), config


def media(kind: str, width: int = 640, height: int = 480, frames: int = 1) -> dict:
    return {"kind": kind, "uri": kind, "width": width, "height": height, "frames": frames, "fps": 8.0}


def sample(turns, items):
    return {"sample_id": "s", "dataset": "d", "source_file": "f", "source_position": 0, "system": None,
            "turns": [{"role": r, "text": t} for r, t in turns], "media": items}  # fmt: skip


def test_image_tokens_are_the_processors_alone_and_among_several(published):
    tok, config = tokenizer_of(published)
    assert (config.profile.kind, config.profile.chat, config.profile.default_system) == (
        "llava_onevision", "llava_onevision", "",
    )  # fmt: skip
    wrapper = oracle.processor(published, load_tokenizer(str(published)))
    crop = np.zeros((1, 1, 3, 384, 384))
    for height, width in SIZES:
        alone = tok.profile.plans([media("image", width, height)])
        several = tok.profile.plans([media("image", width, height), media("image", 64, 48)])
        inputs = {"image_sizes": [[height, width]], "pixel_values": crop}
        expected = wrapper.replace_image_token({**inputs, "batch_num_images": [1]}, 0).count("<image>")
        assert alone[0].num_tokens == expected, (height, width)
        expected = wrapper.replace_image_token({**inputs, "batch_num_images": [2]}, 0).count("<image>")
        assert several[0].num_tokens == expected == 730, (height, width)


@pytest.mark.parametrize(
    "height,width", [(480, 640), (899, 1024), (37, 500), (3000, 200), (385, 383), (64, 64)]
)
def test_crops_are_the_image_processors(published, height, width):
    tok, _ = tokenizer_of(published)
    processor = oracle.image_processor(published)
    image = Image.fromarray(np.random.RandomState(height).randint(0, 256, (height, width, 3), np.uint8))
    for images in ([image], [image, image]):
        expected = processor([images], return_tensors="np")["pixel_values"][0]
        plan = tok.profile.plans([media("image", width, height)] * len(images))[0]
        crops = vision.llava_onevision_crops(
            image, {"grid_h": plan.grid[1], "grid_w": plan.grid[2]}, 384, [0.5] * 3
        )
        half = np.full(3, 0.5, np.float32)
        got = vision.normalize(crops, half, half, axis=1)
        np.testing.assert_allclose(got, expected[: len(got)], rtol=0, atol=1e-6)
        assert len(got) == plan.grid[0] + plan.grid[1] * plan.grid[2]


def test_videos_need_a_fixed_frame_count(published):
    """The published directory takes every frame: a packed batch could not stack its videos."""
    tok, _ = tokenizer_of(published)
    done, quarantined = tok.tokenize([sample([("user", "<video>What moves?"), ("assistant", "A ball.")],
                                             [media("video", frames=12)])])  # fmt: skip
    assert not done and quarantined[0]["reason"] == "media_unsupported"
    assert "fixed frame" in quarantined[0]["detail"]


@pytest.mark.parametrize("total,count", [(6, 3), (11, 8), (300, 8), (10, 4), (37, 5), (48, 48)])
def test_sampled_frames_are_the_video_processors(published, total, count):
    tok, _ = tokenizer_of(published, num_frames=count)
    expected = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=30.0), num_frames=count)
    plan = tok.profile.plan_video(total, 30.0, 64, 64)
    assert list(plan.frame_indices) == expected.tolist()
    assert plan.num_tokens == count * 14 * 14 + 1


@pytest.mark.parametrize(
    "turns",
    [
        [("user", "<image>\nWhat is it?"), ("assistant", "A cat.")],
        [("user", "Compare <image> and <image> please"), ("assistant", " Both\n"), ("user", "And <video>?"),
         ("assistant", "Red.")],
        [("user", "Look <image> then <video>"), ("assistant", "Here <image> too")],
    ],
)  # fmt: skip
def test_media_first_turns_are_the_processors(published, turns):
    """The template writes a turn's images, then its videos, then its texts joined: the ids and
    labels (media never supervised) of transformers' processor on the template's text."""
    tok, _ = tokenizer_of(published, num_frames=2)
    kinds = [p[1:-1] for _, t in turns for p in re.findall(r"<image>|<video>", t)]
    items = [media(kind, 300 + 100 * i, 200, frames=6) for i, kind in enumerate(kinds)]
    (row,), quarantined = tok.tokenize([sample(turns, items)])
    assert not quarantined
    hf = load_tokenizer(str(published))
    wrapper = oracle.processor(published, hf)
    template = (published / "chat_template.jinja").read_text()
    text = hf.apply_chat_template(messages(None, sample(turns, items)["turns"]), chat_template=template,
                                  tokenize=False)  # fmt: skip
    images = [m for m in items if m["kind"] == "image"]
    inputs = {
        "image_sizes": [[m["height"], m["width"]] for m in images],
        "pixel_values": np.zeros((1, 1, 3, 384, 384)),
        "batch_num_images": [len(images)],
    }
    image_texts = iter(wrapper.replace_image_token(inputs, i) for i in range(len(images)))
    video_text = wrapper.replace_video_token({"pixel_values_videos": [np.zeros((2, 3, 1, 1))]}, 0)
    expanded = re.sub(
        r"<image>|<video>", lambda p: next(image_texts) if p[0] == "<image>" else video_text, text
    )
    ids = hf(expanded, add_special_tokens=False).input_ids
    assert row.input_ids.tolist() == ids
    assert row.labels.tolist() == labels_of(hf, expanded, ids, oracle.MEDIA_SPAN)


def test_a_video_before_an_image_is_moved_after_it_as_the_template_does(published):
    """The template writes a turn's images first: mmpack renders the same ids, and the row's media
    follow the tokens (the image first), flagged as reordered."""
    tok, _ = tokenizer_of(published, num_frames=2)
    hf = load_tokenizer(str(published))
    reordered = sample(
        [("user", "<video> then <image>"), ("assistant", "Ok.")], [media("video", frames=4), media("image")]
    )
    (row,), quarantined = tok.tokenize([reordered])
    assert not quarantined and row.reordered
    assert [m["kind"] for m in row.media] == ["image", "video"]
    template = (published / "chat_template.jinja").read_text()
    text = hf.apply_chat_template(messages(None, reordered["turns"]), chat_template=template, tokenize=False)
    assert text.index("<image>") < text.index("<video>")
    image, video = row.media
    assert row.input_ids[image["token_offset"]] == hf.convert_tokens_to_ids("<image>")
    assert row.input_ids[video["token_offset"]] == hf.convert_tokens_to_ids("<video>")
    assert image["token_offset"] < video["token_offset"]


def test_what_mmpack_cannot_count_is_quarantined(published):
    tok, _ = tokenizer_of(
        published, "tokenize.max_tokens=1000", "tokenize.over_length=truncate", num_frames=2
    )
    two = sample([("user", "<image> and"), ("assistant", "Ok."), ("user", "<image>?"), ("assistant", "Ok.")],
                 [media("image"), media("image")])  # fmt: skip
    done, quarantined = tok.tokenize([two])
    assert not done
    assert [q["reason"] for q in quarantined] == ["too_long"]
    assert "truncating would drop media" in quarantined[0]["detail"]


@pytest.mark.parametrize(
    "file,key,value,message",
    [
        ("preprocessor_config.json", "resample", 2, "sets resample 2"),
        ("processor_config.json", "num_image_tokens", 576, "num_image_tokens 576"),
        ("processor_config.json", "vision_feature_select_strategy", "default", "differs from config.json"),
        ("processor_config.json", "vision_aspect_ratio", "anyres", "differs from config.json"),
        ("preprocessor_config.json", "image_grid_pinpoints", [[384, 384]], "image_grid_pinpoints differ"),
        (
            "config.json",
            "video_token_index",
            151000,
            "video_token_index 151000 is not the tokenizer's <video>",
        ),
    ],
)
def test_a_processor_option_mmpack_does_not_reproduce_exits_2(
    published, tmp_path, capsys, monkeypatch, file, key, value, message
):
    assert message in refusal(published, file, {key: value}, tmp_path, capsys, monkeypatch)
