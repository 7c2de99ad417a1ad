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

from mmpack_udfs import schemas

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


def shard_rows(bins: pa.Table, path: str, profile: Mapping[str, Any]) -> pa.Table:
    """One shard's rows of the index before the manifest numbers the shards: ``path`` instead
    of ``shard``. Computed by the task that writes the shard, from the bins in its hands."""
    rows = bin_costs(bins, 0, profile).drop_columns(["shard"])
    return rows.append_column("path", pa.array([path] * bins.num_rows, pa.string()))


def assemble(parts: list[pa.Table], shards: list[dict]) -> pa.Table:
    """The index from every shard's rows (``shard_rows``): shards numbered in manifest order."""
    number = {shard["path"]: i for i, shard in enumerate(shards)}
    if not parts:
        return schemas.COST_INDEX.empty_table()
    rows = pa.concat_tables(parts)
    shard = pa.array([number[path] for path in rows["path"].to_pylist()], pa.int64())
    rows = rows.append_column("shard", shard).sort_by([("shard", "ascending"), ("row", "ascending")])
    return rows.select(list(schemas.COST_INDEX_COLUMNS)).cast(schemas.COST_INDEX)


def to_ipc(table: pa.Table) -> bytes:
    """A table as Arrow IPC stream bytes (how a Spark task hands its rows to the driver)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def index_bytes(index: pa.Table) -> bytes:
    """The index as Parquet bytes: the same table always gives the same bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(index, sink, compression="zstd")
    return sink.getvalue().to_pybytes()
