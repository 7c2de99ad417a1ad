"""The input shapes users have: content-part messages, alpaca records, inline media, audio."""

import base64
import hashlib
import io
import json
import zlib
from pathlib import Path

import pytest
from PIL import Image

from mmpack_udfs.normalize import inputs, media, records
from mmpack_udfs.normalize.records import parse_record
from mmpack_udfs.normalize.sharegpt import BLOB_KEY, Blob, DatasetSpec
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import ROW_KIND_QUARANTINE, ROW_KIND_SAMPLE

SPEC = DatasetSpec(name="d", paths=("x.jsonl",), media_root="/media")
ALPACA = DatasetSpec(name="d", paths=("x.json",), media_root="/media", dialect="alpaca")


def user_parts(*parts):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "ok"}]}


@pytest.mark.parametrize(
    ("part", "kind", "ref"),
    [
        ({"type": "image", "image": "a.jpg"}, "image", "a.jpg"),
        ({"type": "image", "url": "a.jpg"}, "image", "a.jpg"),
        ({"type": "image", "path": "a.jpg"}, "image", "a.jpg"),
        ({"type": "image_url", "image_url": {"url": "a.jpg"}}, "image", "a.jpg"),
        ({"type": "image_url", "value": "a.jpg"}, "image", "a.jpg"),
        ({"type": "video", "video": "v.mp4"}, "video", "v.mp4"),
        ({"type": "video", "url": "v.mp4"}, "video", "v.mp4"),
        ({"type": "video_url", "video_url": {"url": "v.mp4"}}, "video", "v.mp4"),
        ({"type": "video_url", "value": "v.mp4"}, "video", "v.mp4"),
        ({"type": "image", "image": {"bytes": {BLOB_KEY: 0}, "path": "x.png"}}, "image", Blob(0, "x.png")),
    ],
)
def test_every_content_part_form_gives_its_media_in_place(part, kind, ref):
    record = user_parts({"type": "text", "text": "Look: "}, part, {"type": "text", "value": " what?"})
    conversation = parse_record(record, SPEC)
    assert conversation.turns[0] == ("user", f"Look: <{kind}> what?")
    assert conversation.media == [(kind, ref)]


def test_parts_without_a_reference_take_the_media_columns_in_order():
    record = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
            },
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "<image> and an inline <video>"},  # a string turn in the same record
            {"role": "assistant", "content": [{"type": "text", "text": "three"}]},
        ],
        "images": ["1.jpg", "2.jpg", "3.jpg"],
        "videos": ["v.mp4"],
    }
    conversation = parse_record(record, SPEC)
    assert [t for _, t in conversation.turns] == [
        "<image>and<image>",
        "two",
        "<image> and an inline <video>",
        "three",
    ]
    assert conversation.media == [
        ("image", "1.jpg"),
        ("image", "2.jpg"),
        ("image", "3.jpg"),
        ("video", "v.mp4"),
    ]


def test_inline_parts_and_column_media_mix_in_order():
    record = user_parts({"type": "image", "image": "inline.jpg"}, {"type": "text", "text": "vs <image>"})
    record["images"] = ["column.jpg"]
    assert parse_record(record, SPEC).media == [("image", "inline.jpg"), ("image", "column.jpg")]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (user_parts({"type": "input_audio", "input_audio": {"data": "..."}}), Reason.MALFORMED_MEDIA_FIELD),
        (user_parts({"type": "input_audio", "input_audio": "UklGRg=="}), Reason.MALFORMED_MEDIA_FIELD),
        (user_parts({"type": "hologram", "url": "h.bin"}), Reason.UNSUPPORTED_MODALITY),
        (user_parts({"type": "text"}), Reason.NON_STRING_CONTENT),
        (user_parts("bare string"), Reason.NON_STRING_CONTENT),
        (user_parts({"type": "image"}), Reason.PLACEHOLDER_MEDIA_MISMATCH),  # no image to take
        (user_parts({"type": "image", "image": 5}), Reason.MALFORMED_MEDIA_FIELD),
        ({**user_parts({"type": "text", "text": "<audio> what is it?"})}, Reason.PLACEHOLDER_MEDIA_MISMATCH),
        (
            {**user_parts({"type": "text", "text": "hi"}), "audios": ["glass.wav"]},
            Reason.PLACEHOLDER_MEDIA_MISMATCH,
        ),
        (
            {"conversations": [{"from": "human", "value": "<audio>?"}, {"from": "gpt", "value": "glass"}]},
            Reason.PLACEHOLDER_MEDIA_MISMATCH,
        ),
    ],
)
def test_what_cannot_be_encoded_is_refused_with_its_reason(record, reason):
    with pytest.raises(Rejected) as rejected:
        parse_record(record, SPEC)
    assert rejected.value.reason == reason


def test_alpaca_records_read_as_llama_factory_reads_them():
    record = {
        "instruction": "<image>Describe it.",
        "input": "Be brief.",
        "output": "A cat.",
        "system": "You see.",
        "history": [["hi", "hello"]],
        "images": ["cat.jpg"],
    }
    conversation = parse_record(record, ALPACA)
    assert conversation.system == "You see."
    assert conversation.turns == [
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "<image>Describe it.\nBe brief."),
        ("assistant", "A cat."),
    ]
    assert conversation.media == [("image", "cat.jpg")]
    auto = DatasetSpec(name="d", paths=("x.json",), media_root="/m")
    assert parse_record({"instruction": "q", "output": "a"}, auto).turns == [
        ("user", "q"),
        ("assistant", "a"),
    ]
    with pytest.raises(Rejected) as rejected:
        parse_record({"instruction": "q", "output": ""}, ALPACA)
    assert rejected.value.reason == Reason.EMPTY_ASSISTANT_TURN


def test_parquet_bytes_are_set_aside_and_never_read_as_text():
    blobs = []
    row = {"text": "é".encode(), "image": {"bytes": b"ok", "path": "a.png"}, "raw": [b"\xff\xd8 jpeg"]}
    made = inputs._set_aside(row, blobs)
    assert made == {"text": {BLOB_KEY: 0}, "image": {"bytes": {BLOB_KEY: 1}, "path": "a.png"},
                    "raw": [{BLOB_KEY: 2}]}  # fmt: skip
    assert blobs == ["é".encode(), b"ok", b"\xff\xd8 jpeg"]
    json.dumps(made)  # what travels as the raw record is JSON


def png(width=32, height=24, color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` × ``height`` (a decompression bomb)."""
    data = bytearray(png(4, 4))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # IHDR's CRC
    return bytes(data)


def normalize_one(tmp_path, record: dict, blobs: list[bytes] | None = None) -> dict:
    spec = DatasetSpec(name="d", paths=("x",), media_root=str(tmp_path / "root"))
    settings = records.NormalizeSettings(media.ProbeSettings(), media_dir=str(tmp_path / "out" / "media"))
    raw = {"dataset": "d", "source_file": "f", "source_position": 0, "raw": json.dumps(record), "error": None,
           "records_read": None, "blobs": blobs}  # fmt: skip
    return records.RecordNormalizer({"d": spec}, settings)(raw)


def image_record(reference) -> dict:
    return {"conversations": [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "red"}],
            "images": [reference]}  # fmt: skip


def test_inline_bytes_become_a_content_addressed_file_and_hash_into_the_sample_id(tmp_path):
    data = png()
    from_bytes = normalize_one(tmp_path, image_record({"bytes": {BLOB_KEY: 0}, "path": "x.png"}), [data])
    assert from_bytes["kind"] == ROW_KIND_SAMPLE, from_bytes
    [item] = from_bytes["media"]
    digest = hashlib.sha256(data).hexdigest()
    assert item["uri"] == str(tmp_path / "out" / "media" / digest[:2] / f"{digest}.png")
    assert Path(item["uri"]).read_bytes() == data and (item["width"], item["height"]) == (32, 24)
    data_uri = "data:image/png;base64," + base64.b64encode(data).decode()
    from_data_uri = normalize_one(tmp_path, image_record(data_uri))
    assert from_data_uri["sample_id"] == from_bytes["sample_id"]  # the bytes are the identity
    other = normalize_one(tmp_path, image_record({BLOB_KEY: 0}), [png(color=(0, 0, 255))])
    assert other["sample_id"] != from_bytes["sample_id"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00\xffnot an image at all", Reason.MEDIA_UNREADABLE),
        (png()[:40], Reason.MEDIA_UNREADABLE),  # truncated
        (png_claiming(40000, 40000), Reason.IMAGE_TOO_LARGE),  # the pixel limit before any decode
    ],
)
def test_bad_inline_images_get_the_reasons_files_get(tmp_path, data, reason):
    row = normalize_one(tmp_path, image_record({BLOB_KEY: 0}), [data])
    assert row["kind"] == ROW_KIND_QUARANTINE and row["reason"] == reason
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    (root / "same.png").write_bytes(data)
    assert normalize_one(tmp_path, image_record("same.png"))["reason"] == reason
    assert not (tmp_path / "out" / "media").exists()  # nothing kept of refused media


def test_urls_are_refused_and_nothing_is_fetched(tmp_path):
    row = normalize_one(tmp_path, image_record("https://example.invalid/cat.jpg"))
    assert row["kind"] == ROW_KIND_QUARANTINE and row["reason"] == Reason.MEDIA_REMOTE


def test_an_inline_video_is_probed_and_kept_like_a_file(tmp_path):
    import random

    from mmpack_udfs.demo.data import _write_video

    data = (tmp_path / "made" / "media" / _write_video(tmp_path / "made", 0, random.Random(0))).read_bytes()
    record = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video", "video": {"bytes": {BLOB_KEY: 0}, "path": "clip.mp4"}}],
            },
            {"role": "assistant", "content": "A moving square."},
        ]
    }
    row = normalize_one(tmp_path, record, [data])
    assert row["kind"] == ROW_KIND_SAMPLE, row
    [item] = row["media"]
    assert item["kind"] == "video" and item["frames"] > 0 and item["uri"].endswith(".mp4")
    assert Path(item["uri"]).read_bytes() == data
    broken = normalize_one(tmp_path, record, [data[: len(data) // 20]])
    assert broken["kind"] == ROW_KIND_QUARANTINE and broken["reason"] in (
        Reason.MEDIA_UNREADABLE,
        Reason.VIDEO_NO_FRAMES,
    )
