"""Per-bin cost figures: what a trainer needs to balance data-parallel ranks, from a shard's
own columns (pyarrow and numpy only: the loader imports this too).

The vision encoder attends within blocks: a Qwen2-VL image or video attends per temporal
patch (``grid_t`` blocks of ``grid_h × grid_w`` patches), an InternVL tile is one block of
``4 × tokens_per_tile`` patches (2 × 2 patches merge into one token in both profiles).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs import fs, schemas

SHARD_COLUMNS = ["num_tokens", "sum_sq_lengths", "vision_patches", "supervised_tokens"]
MEDIA_FIELDS = ["grid_t", "grid_h", "grid_w", "num_tokens"]


def bin_costs(bins: pa.Table, shard: int, profile: Mapping[str, Any]) -> pa.Table:
    """The cost index rows of one shard's bins (``bins`` holds at least SHARD_COLUMNS and
    ``media`` with MEDIA_FIELDS)."""
    media = bins["media"].combine_chunks()
    items = pc.list_flatten(media)
    counts = pc.list_value_length(media).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    owner = np.repeat(np.arange(bins.num_rows), counts)
    field = {name: items.field(name).to_numpy(zero_copy_only=False).astype(np.int64) for name in MEDIA_FIELDS}
    if profile["kind"] == "qwen2_vl":
        blocks, block_patches = field["grid_t"], field["grid_h"] * field["grid_w"]
    else:  # internvl: tiles of 4 × tokens_per_tile patches each
        per_tile = int(profile["image"]["tokens_per_tile"])
        blocks, block_patches = field["num_tokens"] // per_tile, np.full(len(owner), 4 * per_tile)
    squares = np.bincount(owner, weights=blocks * block_patches**2, minlength=bins.num_rows)
    column = {name: bins[name].to_numpy().astype(np.int64) for name in SHARD_COLUMNS}
    return pa.table(
        {
            "shard": np.full(bins.num_rows, shard, np.int64),
            "row": np.arange(bins.num_rows, dtype=np.int64),
            "tokens": column["num_tokens"],
            "sum_sq_lengths": column["sum_sq_lengths"],
            "media_items": counts,
            "vision_patches": column["vision_patches"],
            "vision_sq_patches": squares.astype(np.int64),
            "supervised_tokens": column["supervised_tokens"],
        },
        schema=schemas.COST_INDEX,
    )


def shard_costs(uri: str, shard: int, profile: Mapping[str, Any], s3: fs.S3Options | None) -> pa.Table:
    """The cost index rows of one published shard, reading only the columns they need."""
    filesystem, path = fs.filesystem(uri, s3)
    with filesystem.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        columns = SHARD_COLUMNS + schemas.nested_field_paths(parquet.schema, "media", MEDIA_FIELDS)
        return bin_costs(parquet.read(columns=columns), shard, profile)


def cost_index(
    packed_root: str, shards: list[dict], profile: Mapping[str, Any], s3: fs.S3Options | None
) -> pa.Table:
    """The whole index: every shard of ``shards`` (manifest entries, in manifest order)."""
    parts = [shard_costs(fs.join(packed_root, s["path"]), i, profile, s3) for i, s in enumerate(shards)]
    return pa.concat_tables(parts) if parts else schemas.COST_INDEX.empty_table()


def index_bytes(index: pa.Table) -> bytes:
    """The index as Parquet bytes: the same table always gives the same bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(index, sink, compression="zstd")
    return sink.getvalue().to_pybytes()
