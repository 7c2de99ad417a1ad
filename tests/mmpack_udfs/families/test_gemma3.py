"""Gemma 3 without Spark: ids and labels against transformers' Gemma3Processor on the real Gemma 3
tokenizer and chat template (system prompt at the head of the first turn, trimmed texts, images
anywhere, side by side, in a model turn), squares against its image processor, what is
quarantined (videos, turns that do not alternate), and the options mmpack refuses (exit 2)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from loader import vision
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from tests.mmpack_udfs.families.test_model_dir import refusal
from tests.models.build import build_model_dir
from tests.oracles import gemma3 as oracle

SIZES = [(480, 640), (900, 50), (896, 896), (37, 3000), (1, 1)]  # (height, width)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return build_model_dir("gemma3", tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Image files of SIZES (random pixels), as media rows by index."""
    root = tmp_path_factory.mktemp("gemma3-images")
    out = []
    for i, (height, width) in enumerate(SIZES):
        path = root / f"{i}.png"
        Image.fromarray(np.random.RandomState(i).randint(0, 256, (height, width, 3), np.uint8)).save(path)
        out.append(
            {"kind": "image", "uri": str(path), "width": width, "height": height, "frames": 1, "fps": 0.0}
        )
    return out


@pytest.fixture(scope="module")
def tok(published) -> SampleTokenizer:
    config = load_run(None, [f"tokenize.model={published}", "tokenize.max_tokens=100000"]).config
    return SampleTokenizer(TokenizeSettings.from_config(config))


@pytest.fixture(scope="module")
def hf(published):
    return load_tokenizer(str(published))


def sample(turns, items, system=None) -> dict:
    return {
        "sample_id": "s",
        "dataset": "d",
        "source_file": "f",
        "source_position": 0,
        "system": system,
        "turns": [{"role": r, "text": t} for r, t in turns],
        "media": items,
    }


CONVERSATIONS = [
    (None, [("user", "<image>\nWhat is it?"), ("assistant", "A cat.")], [0]),
    (
        "Be brief.",
        [
            ("user", "Compare <image> and <image> please"),
            ("assistant", " Both\n"),
            ("user", "  and? "),
            ("assistant", "Red.<image> there"),
        ],
        [0, 1, 2],
    ),
    (" Spaced system. ", [("user", "<image><image>"), ("assistant", "ok")], [3, 4]),
    (None, [("user", "\n\ntext only\n"), ("assistant", "\n\nyes  ")], []),
    (
        None,
        [("user", "Look:<image>"), ("assistant", "Sure."), ("user", "<image>\n\n"), ("assistant", "No.")],
        [1, 0],
    ),
]


@pytest.mark.parametrize("system,turns,picks", CONVERSATIONS)
def test_ids_and_labels_are_the_processors(published, tok, hf, images, system, turns, picks):
    """Ids, labels (model turns, image spans excluded), tokens per image: transformers' own."""
    conversation = sample(turns, [images[i] for i in picks], system)
    (row,), quarantined = tok.tokenize([conversation])
    assert not quarantined
    ref = oracle.reference(published, hf, conversation)
    assert row.input_ids.tolist() == ref["input_ids"]
    assert row.labels.tolist() == ref["labels"]
    assert [m["num_tokens"] for m in row.media] == ref["tokens"] == [256] * len(picks)


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_squares_are_the_image_processors(published, images, index):
    processor = oracle.image_processor(published)
    with Image.open(images[index]["uri"]) as image:
        rgb = image.convert("RGB")
    expected = processor([rgb], return_tensors="np")["pixel_values"]
    square = vision.resized_rgb8([rgb], 896, 896, Image.Resampling.BILINEAR).transpose(0, 3, 1, 2)
    half = np.full(3, 0.5, np.float32)
    np.testing.assert_allclose(vision.normalize(square, half, half, axis=1), expected, rtol=0, atol=1e-6)


def test_videos_and_turns_the_template_refuses_are_quarantined(tok, images):
    video = {**images[0], "kind": "video", "frames": 8, "fps": 4.0}
    done, quarantined = tok.tokenize(
        [
            sample([("user", "<video>What moves?"), ("assistant", "A ball.")], [video]),
            sample([("assistant", "Hello."), ("user", "Hi")], []),
            sample([("user", "a"), ("user", "b"), ("assistant", "c")], []),
        ]
    )
    assert not done
    assert [q["reason"] for q in quarantined] == ["media_unsupported", "template_refuses", "template_refuses"]
    assert "no videos" in quarantined[0]["detail"] and "alternate" in quarantined[1]["detail"]


@pytest.mark.parametrize(
    "file,key,value,message",
    [
        ("preprocessor_config.json", "do_pan_and_scan", True, "do_pan_and_scan"),
        ("preprocessor_config.json", "resample", 3, "sets resample 3"),
        ("preprocessor_config.json", "size", {"height": 448, "width": 448}, "448 px image"),
        ("processor_config.json", "image_seq_length", 64, "64 tokens per 896 px image"),
        ("config.json", "image_token_index", 262000, "image_token_index 262000 is not the tokenizer's"),
        ("config.json", "boi_token_index", 3, "boi_token_index 3 is not the tokenizer's <start_of_image>"),
    ],
)
def test_a_processor_option_mmpack_does_not_reproduce_exits_2(
    published, tmp_path, capsys, monkeypatch, file, key, value, message
):
    assert message in refusal(published, file, {key: value}, tmp_path, capsys, monkeypatch)
