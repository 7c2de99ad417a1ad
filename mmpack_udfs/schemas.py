"""The one definition of every table schema mmpack writes (Arrow), and the output layout.

Both the jobs and any reader import these; nothing else spells a column list.
"""

from __future__ import annotations

import pyarrow as pa

from mmpack_udfs import fs

# Turn texts in the samples table mark media with these placeholders, whatever the input used.
IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "<image>", "<video>"

TURN = pa.struct([("role", pa.string()), ("text", pa.string())])

MEDIA = pa.struct(
    [
        ("kind", pa.string()),  # "image" | "video"
        ("uri", pa.string()),  # resolved: absolute local path or s3:// URI
        ("file_bytes", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("frames", pa.int32()),  # video only
        ("fps", pa.float64()),  # video only
        ("duration", pa.float64()),  # video only, seconds
    ]
)

SAMPLES = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("source_position", pa.int64(), nullable=False),
        pa.field("system", pa.string()),
        pa.field("turns", pa.list_(TURN), nullable=False),
        pa.field("media", pa.list_(MEDIA), nullable=False),
    ]
)

QUARANTINE = pa.schema(
    [
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("source_position", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
        pa.field("raw", pa.string()),
        pa.field("raw_truncated", pa.bool_(), nullable=False),
    ]
)

# What the normalize step emits per record before the tables are split apart:
# a sample, a quarantine row, or (one per input split) the count of records read.
ROW_KIND_SAMPLE, ROW_KIND_QUARANTINE, ROW_KIND_SPLIT = "sample", "quarantine", "split"
NORMALIZED = pa.schema(
    [pa.field("kind", pa.string(), nullable=False)]
    + [f.with_nullable(True) for f in SAMPLES]
    + [f.with_nullable(True) for f in QUARANTINE if f.name not in SAMPLES.names]
    + [pa.field("records_read", pa.int64())]
)

TOKENIZED_MEDIA = pa.struct(
    [
        ("kind", pa.string()),
        ("uri", pa.string()),
        ("width", pa.int32()),  # as stored
        ("height", pa.int32()),
        ("grid_t", pa.int32()),  # qwen2_vl: temporal patches; internvl: frames
        ("grid_h", pa.int32()),  # qwen2_vl: 14 px patch rows; internvl: tile rows
        ("grid_w", pa.int32()),
        ("resized_height", pa.int32()),  # what the vision encoder sees (per tile for internvl)
        ("resized_width", pa.int32()),
        ("token_offset", pa.int32()),  # index of the first pad token in input_ids
        ("num_tokens", pa.int32()),  # pad tokens of this item
        ("frame_indices", pa.list_(pa.int32())),  # videos: the frames to decode, in order
    ]
)

TOKENIZED = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # parent id, or parent-k when split
        pa.field("parent_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("labels", pa.list_(pa.int32()), nullable=False),  # -100: not supervised
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("text_tokens", pa.int32(), nullable=False),
        pa.field("image_tokens", pa.int32(), nullable=False),
        pa.field("video_tokens", pa.int32(), nullable=False),
        pa.field("supervised_tokens", pa.int32(), nullable=False),
        pa.field("media", pa.list_(TOKENIZED_MEDIA), nullable=False),
    ]
)

TOKENIZE_QUARANTINE = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("source_position", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
        pa.field("num_tokens", pa.int64()),
    ]
)

TABLES = {
    "samples": SAMPLES,
    "quarantine": QUARANTINE,
    "tokenized": TOKENIZED,
    "tokenize_quarantine": TOKENIZE_QUARANTINE,
}


def table_uri(output: str, name: str) -> str:
    """``OUT/tables/<name>``: where a Delta table of one pipeline run lives."""
    return fs.join(output, "tables", name)


def report_uri(output: str, name: str) -> str:
    """``OUT/report/<name>``: reports and summaries of one pipeline run."""
    return fs.join(output, "report", name)


def packed_uri(output: str) -> str:
    """``OUT/packed``: packed shards and manifest.json."""
    return fs.join(output, "packed")
