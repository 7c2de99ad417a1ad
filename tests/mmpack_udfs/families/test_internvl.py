"""transformers-native InternVL without Spark: the tile grid, frame sampling and the text of
every-frame videos against transformers' own functions and processor; the directory's
settings, and the processor options mmpack refuses (exit 2, naming them)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

from mmpack_udfs.families.internvl import got_ocr2_grid
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from tests.mmpack_udfs.families.test_model_dir import refusal
from tests.models.build import build_model_dir
from tests.oracles import internvl as oracle
from tests.oracles.qwen_family import labels_of, messages

SIZES = [(w, h) for w in (1, 28, 100, 224, 300, 448, 500, 640, 700, 896, 1000, 1344, 1920, 4000) for h in
         (1, 50, 100, 200, 224, 448, 480, 600, 720, 1080, 1200, 3000)]  # fmt: skip


@pytest.mark.parametrize("min_tiles,max_tiles", [(1, 12), (1, 6), (2, 9), (1, 1)])
def test_the_tile_grid_is_transformers(min_tiles, max_tiles):
    for width, height in SIZES:
        expected = get_optimal_tiled_canvas((height, width), (448, 448), min_tiles, max_tiles)
        assert got_ocr2_grid(width, height, 448, min_tiles, max_tiles) == tuple(expected), (width, height)


@pytest.fixture(scope="module")
def every_frame(tmp_path_factory):
    """The published directory as it is: no video processor config, so every frame of a clip."""
    target = build_model_dir("internvl", tmp_path_factory.mktemp("internvl") / "model")
    (target / "video_preprocessor_config.json").unlink()
    return target


def tokenizer_of(directory, **overrides):
    config = load_run(None, [f"tokenize.model={directory}", "tokenize.max_tokens=100000"]).config
    for key, value in overrides.items():
        config.profiles["model"].video.__setattr__(key, value)
    return SampleTokenizer(TokenizeSettings.from_config(config)), config


def test_the_published_directory_takes_every_frame_with_the_image_settings(every_frame):
    tok, config = tokenizer_of(every_frame)
    video = config.profiles["model"].video
    assert (video.do_sample_frames, video.height, video.width, list(video.mean)) == (
        False, 448, 448, [0.485, 0.456, 0.406],
    )  # fmt: skip
    assert tok.profile.plan_video(37, 8.0, 320, 240).frame_indices == tuple(range(37))
    assert (config.profile.chat, config.profile.default_system) == ("internvl", "")


@pytest.mark.parametrize("total,count", [(6, 3), (11, 8), (300, 8), (10, 4), (37, 5), (48, 48)])
def test_sampled_frames_are_the_video_processors(every_frame, total, count):
    """InternVLVideoProcessor.sample_frames with num_frames: arange(total / n / 2, total, total / n).int()."""
    tok, _ = tokenizer_of(every_frame, do_sample_frames=True, num_frames=count)
    expected = torch.arange(total / count / 2, total, total / count).int().tolist()
    assert list(tok.profile.plan_video(total, 30.0, 64, 64).frame_indices) == expected


def item(kind: str, frames: int) -> dict:
    if kind == "video":
        return {"kind": kind, "uri": "v", "width": 64, "height": 48, "frames": frames, "fps": 8.0}
    return {"kind": kind, "uri": "i", "width": 448, "height": 448, "frames": 1, "fps": 0.0}


def sample(turns, media):
    return {"sample_id": "s", "dataset": "d", "source_file": "f", "source_position": 0, "system": None,
            "turns": [{"role": r, "text": t} for r, t in turns], "media": media}  # fmt: skip


@pytest.mark.parametrize(
    "turns",
    [
        [("user", "Watch this <video> now."), ("assistant", "A ball.")],
        [("user", "<video>\n\nWhat moves?"), ("assistant", " It rolls <video>, see  <image>")],
        [("user", "Two: <video><video>"), ("assistant", "Both\nspin.")],
    ],
)
def test_every_frame_videos_and_frame_labels_after_text_are_the_processors(every_frame, turns):
    """Frame labels join the text before them (``this Frame1: ``) as the processor's expanded
    string is tokenized; a video in a supervised turn leaves its labels unsupervised."""
    tok, _ = tokenizer_of(every_frame)
    frames = [9, 4, 12]
    kinds = [p[1:-1] for _, t in turns for p in re.findall(r"<image>|<video>", t)]
    media = [item(kind, frames[i % 3]) for i, kind in enumerate(kinds)]
    (row,), quarantined = tok.tokenize([sample(turns, media)])
    assert not quarantined
    hf = load_tokenizer(str(every_frame))
    wrapper = oracle.processor(every_frame, hf)
    template = (every_frame / "chat_template.jinja").read_text()
    text = hf.apply_chat_template(
        messages(None, sample(turns, media)["turns"]), chat_template=template, tokenize=False
    )
    replacements = iter(
        wrapper.replace_video_token({"pixel_values_videos": [np.zeros((m["frames"], 3, 1, 1))]}, 0)
        if m["kind"] == "video" else wrapper.replace_image_token({"num_patches": [1]}, 0)
        for m in media
    )  # fmt: skip
    expanded = re.sub(r"<IMG_CONTEXT>|<video>", lambda _: next(replacements), text)
    ids = hf(expanded, add_special_tokens=False).input_ids
    assert row.input_ids.tolist() == ids
    assert row.labels.tolist() == labels_of(hf, expanded, ids, oracle.MEDIA_SPAN)


@pytest.mark.parametrize(
    "file,key,value,message",
    [
        ("preprocessor_config.json", "resample", 2, "sets resample 2"),
        ("preprocessor_config.json", "size", {"height": 448, "width": 336}, "is not a square tile"),
        (
            "processor_config.json",
            "image_seq_length",
            64,
            "image_seq_length 64 (processor_config.json) differs",
        ),
        ("preprocessor_config.json", "do_center_crop", True, "do_center_crop"),
        (
            "config.json",
            "image_token_id",
            151000,
            "image_token_id 151000 is not the tokenizer's <IMG_CONTEXT>",
        ),
    ],
)
def test_a_processor_option_mmpack_does_not_reproduce_exits_2(
    every_frame, tmp_path, capsys, monkeypatch, file, key, value, message
):
    assert message in refusal(every_frame, file, {key: value}, tmp_path, capsys, monkeypatch)
