"""The one definition of every table schema mmpack writes (Arrow), and the output layout.

Both the jobs and any reader import these; nothing else spells a column list.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs

# Turn texts in the samples table mark media with these placeholders, whatever the input used.
IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER = "<image>", "<video>", "<audio>"
# any placeholder, as one group (``split`` keeps them)
MEDIA_PLACEHOLDER = re.compile(
    "(" + "|".join(re.escape(p) for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER)) + ")"
)

TURN = pa.struct([("role", pa.string()), ("text", pa.string())])

MEDIA = pa.struct(
    [
        ("kind", pa.string()),  # "image" | "video" | "audio"
        ("uri", pa.string()),  # resolved: absolute local path or s3:// URI
        ("file_bytes", pa.int64()),
        ("width", pa.int32()),  # images and videos
        ("height", pa.int32()),
        # video: frames that decode; audio: samples of its 16 kHz mono waveform (loader.audio.decode)
        ("frames", pa.int32()),
        ("fps", pa.float64()),  # video only
        ("duration", pa.float64()),  # video and audio, seconds
        ("sample_rate", pa.int32()),  # audio only: the stream's rate, as stored
        ("channels", pa.int32()),  # audio only
        # video, with tokenize.use_audio_in_video: samples of its audio track's 16 kHz mono waveform
        ("audio_samples", pa.int32()),
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
        # a preference pair (datasets with ``ranking: true``): the rejected answer, which takes the
        # place of the last turn (the chosen answer); null for an SFT conversation
        pa.field("rejected", pa.string()),
        pa.field("weight", pa.float64(), nullable=False),  # the record's loss weight (1: none given)
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

# What the normalize step emits per record before the tables are split apart: a sample, a
# quarantine row, or (one per input split) the count of records read. Its tasks hand Spark all
# but the samples, which they write as sorted runs (normalize/sample_runs.py), and a row per run
# and dataset: the run's file as ``source_file``, its samples of the dataset as ``samples``.
ROW_KIND_SAMPLE, ROW_KIND_QUARANTINE, ROW_KIND_SPLIT = "sample", "quarantine", "split"
ROW_KIND_RUN = "run"
NORMALIZED = pa.schema(
    [pa.field("kind", pa.string(), nullable=False)]
    + [f.with_nullable(True) for f in SAMPLES]
    + [f.with_nullable(True) for f in QUARANTINE if f.name not in SAMPLES.names]
    + [pa.field("records_read", pa.int64()), pa.field("samples", pa.int64())]
)

TOKENIZED_MEDIA = pa.struct(
    [
        ("kind", pa.string()),
        ("uri", pa.string()),
        ("width", pa.int32()),  # as stored
        ("height", pa.int32()),
        ("grid_t", pa.int32()),  # qwen: temporal patches; internvl: frames
        ("grid_h", pa.int32()),  # qwen: vision patch rows (14 or 16 px); internvl: tile rows
        ("grid_w", pa.int32()),
        ("resized_height", pa.int32()),  # what the vision encoder sees (per tile for internvl)
        ("resized_width", pa.int32()),
        ("token_offset", pa.int32()),  # index of the first pad token in input_ids
        ("num_tokens", pa.int32()),  # pad tokens of this item
        ("frame_indices", pa.list_(pa.int32())),  # videos: the frames to decode, in order
        ("second_per_grid_t", pa.float32()),  # videos: seconds per temporal patch (Qwen2.5-VL mRoPE)
        # pad runs of an item split by text (Qwen3-VL's timestamped frame groups): each run's
        # start, from token_offset; null for one run
        ("group_starts", pa.list_(pa.int32())),
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
        # a preference pair's sequence: "chosen" (sample id <parent>-chosen) or "rejected"
        # (<parent>-rejected), packed side by side in one bin; null for an SFT sample
        pa.field("pair_side", pa.string()),
        pa.field("weight", pa.float64(), nullable=False),  # samples.weight
    ]
)

PAIR_SIDES = ("chosen", "rejected")

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

# Packed shards: one row per bin (docs/FORMAT.md describes every field).
SHARD_FORMAT = "mmpack-packed"
SHARD_FORMAT_VERSION = 2
# version 2: an embedded item whose file an earlier item of its bin embeds holds no copy of it
# (``shared_media_data``); version 1's shards read the same way
READABLE_SHARD_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"

SHARD_MEDIA = pa.struct(
    [
        ("sample_index", pa.int32()),  # which sample of the bin (index into sample_ids)
        ("kind", pa.string()),
        ("uri", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("grid_t", pa.int32()),
        ("grid_h", pa.int32()),
        ("grid_w", pa.int32()),
        ("resized_height", pa.int32()),
        ("resized_width", pa.int32()),
        ("token_offset", pa.int32()),  # index of the first pad token in the bin's input_ids
        ("num_tokens", pa.int32()),
        ("frame_indices", pa.list_(pa.int32())),
        ("second_per_grid_t", pa.float32()),
        ("group_starts", pa.list_(pa.int32())),  # from token_offset; null for one pad run
        # the file's bytes; null when the shard references media only, or (version 2) when an
        # earlier item of the bin embeds the same file (shared_media_data)
        ("data", pa.binary()),
    ]
)

SHARD = pa.schema(
    [
        pa.field("group", pa.int32(), nullable=False),  # packing group (one Spark task)
        pa.field("bin", pa.int32(), nullable=False),  # bin index within its group
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),  # samples concatenated
        pa.field("labels", pa.list_(pa.int32()), nullable=False),  # -100: not supervised
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),  # [0, l1, l1+l2, ..., tokens]
        pa.field("sample_ids", pa.list_(pa.string()), nullable=False),
        # each sample's dataset; added within version 1: shards written before it lack the column
        pa.field("sample_datasets", pa.list_(pa.string()), nullable=False),
        # each sample's pair side (null: not a preference pair); a pair's chosen sequence is
        # immediately followed by its rejected one. Added within version 1
        pa.field("sample_pair_sides", pa.list_(pa.string()), nullable=False),
        # each sample's loss weight: its record's weight times its dataset's loss_weight (1:
        # plain); added within version 1
        pa.field("sample_weights", pa.list_(pa.float64()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_samples", pa.int32(), nullable=False),
        pa.field("image_tokens", pa.int32(), nullable=False),
        pa.field("video_tokens", pa.int32(), nullable=False),
        pa.field("supervised_tokens", pa.int32(), nullable=False),
        pa.field("sum_sq_lengths", pa.int64(), nullable=False),  # attention cost: sum of l^2
        pa.field("vision_patches", pa.int64(), nullable=False),  # 14 px patches before the 2x2 merge
        pa.field("media", pa.list_(SHARD_MEDIA), nullable=False),
    ]
)


def shared_media_data(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One bin's media items (``SHARD_MEDIA`` as dicts) with every item's bytes: an item whose
    file an earlier item of the bin embeds (a video and its own audio track, a preference pair's
    two sides) is written without a copy, and takes that item's bytes here (in place). An item
    with no embedded copy keeps null: the pack references it by ``uri``."""
    embedded: dict[str, Any] = {}
    for item in items:
        if item["data"] is not None:
            embedded.setdefault(item["uri"], item["data"])
        elif item["uri"] in embedded:
            item["data"] = embedded[item["uri"]]
    return items


# in the order they were added
ADDED_SHARD_COLUMNS = ("sample_datasets", "sample_pair_sides", "sample_weights")


def is_shard_schema(schema: pa.Schema) -> bool:
    """The shard schema as of some point of version 1: the current one, or without the columns
    added since that point (docs/FORMAT.md: Compatibility)."""
    for since in range(len(ADDED_SHARD_COLUMNS) + 1):
        later = ADDED_SHARD_COLUMNS[since:]
        if schema.equals(pa.schema([f for f in SHARD if f.name not in later])):
            return True
    return False


# An Energon export (``mmpack export energon``; read by ``loader.energon``): one tar sample per
# bin, its parts: "json" (the bin's other columns, its media items without their bytes, and
# "mmpack": where it came from), each of EXPORT_ARRAYS as an int32 "<name>.npy", and each media
# item's bytes as "<i>.media". EXPORT_MANIFEST beside the tars says what the export holds.
EXPORT_FORMAT, EXPORT_FORMAT_VERSION = "mmpack-energon", 1
EXPORT_MANIFEST = "mmpack_export.json"
EXPORT_ARRAYS = ("input_ids", "labels", "cu_seqlens")


def profile_digest(profile: Mapping[str, Any]) -> str:
    """A short digest of a profile's settings: which model a bin was packed for."""
    return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()[:16]


# Per-bin figures: the columns a report or a rank balancer reads without touching tokens.
SHARD_FIGURES = (
    "num_tokens",
    "num_samples",
    "image_tokens",
    "video_tokens",
    "supervised_tokens",
    "sum_sq_lengths",
    "vision_patches",
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


def packed_eval_uri(output: str) -> str:
    """``OUT/packed-eval``: the evaluation split's shards and manifest.json (eval.fraction,
    datasets[].eval_samples); the training manifest names its run in ``eval``."""
    return fs.join(output, "packed-eval")


def manifest_uri(output: str) -> str:
    """``OUT/packed/manifest.json``: the one file a reader opens; written last."""
    return fs.join(packed_uri(output), MANIFEST_NAME)


class ManifestError(MmpackError, RuntimeError):
    """No manifest, an unreadable one, or one of another format or format version."""


def load_manifest(uri: str, storage: fs.Storage = fs.LOCAL) -> dict[str, Any]:
    """Read manifest.json at ``uri`` and check it is one this version of mmpack writes."""
    try:
        manifest = json.loads(storage.read_bytes(uri))
    except FileNotFoundError as err:
        raise ManifestError(f"no manifest at {uri}: nothing is published there (run the pack stage)") from err
    except OSError as err:  # S3 reports a missing key as an OSError
        raise ManifestError(f"cannot read the manifest {uri}: {err}") from err
    except ValueError as err:
        raise ManifestError(f"{uri} is not valid JSON: {err}") from err
    if manifest.get("format") != SHARD_FORMAT:
        raise ManifestError(f"{uri} is not an mmpack manifest (format {manifest.get('format')!r})")
    if manifest.get("format_version") not in READABLE_SHARD_VERSIONS:
        raise ManifestError(
            f"{uri} has format version {manifest.get('format_version')}; this version of mmpack "
            f"reads versions {', '.join(map(str, READABLE_SHARD_VERSIONS))}"
        )
    return manifest


# Pillow image modes whose conversion to 8-bit RGB keeps what the pixels mean. The others
# (16-bit "I;16*", 32-bit "I", float "F") clip to saturated or black pixels, with no warning,
# in Pillow and so in the model's processor: normalize quarantines such images
# (media_unsupported) and the loader refuses them. One rule for both sides.
RGB_CONVERTIBLE_MODES = frozenset(
    {"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}
)


# The per-bin cost index (cost_index.parquet beside manifest.json, named and hashed in it):
# one row per bin, in manifest shard order then row order, so a trainer plans an epoch
# without opening a shard. See docs/FORMAT.md and mmpack_udfs/pack/costs.py.
COST_INDEX_NAME = "cost_index.parquet"
COST_INDEX_COLUMNS = (
    "shard",  # index into the manifest's shards
    "row",  # row of the bin in its shard
    "tokens",
    "sum_sq_lengths",  # Σ l² over the bin's samples: the LLM's attention term
    "media_items",
    "vision_patches",  # vision encoder input patches
    "vision_sq_patches",  # Σ over the encoder's attention blocks (frames, tiles) of patches²
    "supervised_tokens",
)
COST_INDEX = pa.schema([pa.field(name, pa.int64(), nullable=False) for name in COST_INDEX_COLUMNS])


def nested_field_paths(parquet_schema: Any, column: str, fields: list[str]) -> list[str]:
    """Parquet paths of some fields of a list<struct> column, to read them without the rest
    (``pq.ParquetFile(...).schema`` in, e.g. ``media.list.element.grid_t`` out). A field that
    is itself a list has a longer path (``media.list.element.group_starts.list.element``): the
    field is the component after the list's element, whatever follows it."""
    paths = [parquet_schema.column(i).path.split(".") for i in range(len(parquet_schema))]
    return [".".join(p) for p in paths if p[0] == column and len(p) > 3 and p[3] in fields]
