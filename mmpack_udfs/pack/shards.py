"""Packed shards: turn tokenized rows + a packing into bin rows, and write them as Parquet.

Bins are built column-wise with Arrow and numpy: the rows of a shard are taken in bin
order, so the flattened ``input_ids`` of the taken rows already are the concatenated
bins; only list offsets are computed. The one per-item Python loop reads media files.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.constants import VISION_PATCHES_PER_TOKEN
from mmpack_udfs.io import fs

# What the pack stage needs from the tokenized table.
TOKENIZED_COLUMNS = [
    "sample_id",
    "dataset",
    "input_ids",
    "labels",
    "num_tokens",
    "image_tokens",
    "video_tokens",
    "supervised_tokens",
    "media",
    "pair_side",
    "weight",
]

TOKENIZED_LISTS = pa.schema([schemas.TOKENIZED.field(name) for name in TOKENIZED_COLUMNS])
TOKEN_COLUMNS = ("input_ids", "labels")  # list<int32>: what the JVM carries as bytes (below)
# the tokenized rows as the shard tasks receive them: the token columns as bytes, which Spark's
# shuffle, sort and Arrow conversion copy whole instead of value by value
TOKENIZED_ROWS = pa.schema(
    [
        schemas.TOKENIZED.field(name).with_type(pa.binary()) if name in TOKEN_COLUMNS
        else schemas.TOKENIZED.field(name)
        for name in TOKENIZED_COLUMNS
    ]
)  # fmt: skip


def lists_as_bytes(column: pa.Array) -> pa.BinaryArray:
    """A list<int32> array as binary: each list's values, their bytes in place (no copy)."""
    values = column.flatten()
    offsets = column.offsets.to_numpy().astype(np.int64)
    starts = ((offsets - offsets[0]) * 4).astype(np.int32)
    data = values.buffers()[1].slice(values.offset * 4, len(values) * 4)
    return pa.BinaryArray.from_buffers(pa.binary(), len(column), [None, pa.py_buffer(starts), data])


def bytes_as_lists(column: pa.Array) -> pa.ListArray:
    """``lists_as_bytes`` undone: the list<int32> array (no copy of the values)."""
    offsets = np.frombuffer(column.buffers()[1], np.int32)[column.offset : column.offset + len(column) + 1]
    offsets = offsets.astype(np.int64)
    first, total = int(offsets[0]), int(offsets[-1] - offsets[0]) // 4
    values = pa.Array.from_buffers(pa.int32(), total, [None, column.buffers()[2].slice(first, total * 4)])
    return pa.ListArray.from_arrays(pa.array((offsets - first) // 4, pa.int32()), values)


def rows_as_bytes(rows: pa.RecordBatch) -> pa.RecordBatch:
    """Tokenized rows (``TOKENIZED_COLUMNS``) with their token columns as bytes."""
    columns = [
        lists_as_bytes(rows.column(n)) if n in TOKEN_COLUMNS else rows.column(n) for n in rows.schema.names
    ]
    return pa.RecordBatch.from_arrays(columns, schema=TOKENIZED_ROWS)


def rows_as_lists(rows: pa.RecordBatch) -> pa.RecordBatch:
    """Rows with ``TOKENIZED_ROWS``' byte columns (and any others) back to list<int32>."""
    names = rows.schema.names
    columns = [bytes_as_lists(rows.column(n)) if n in TOKEN_COLUMNS else rows.column(n) for n in names]
    return pa.RecordBatch.from_arrays(columns, names=names)


def read_tokenized_files(
    batches: Iterator[pa.RecordBatch], storage: fs.Storage, batch_rows: int = 2000
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: runs of tokenized files' URIs in (``uris``), their rows out
    (``rows_as_bytes``), ``batch_rows`` at a time."""
    for batch in batches:
        for uri in itertools.chain.from_iterable(batch.column("uris").to_pylist()):
            yield from map(rows_as_bytes, tokenized_batches(uri, storage, batch_rows))


def tokenized_batches(uri: str, storage: fs.Storage, batch_rows: int = 2000) -> Iterator[pa.RecordBatch]:
    """A tokenized file's rows (``TOKENIZED_COLUMNS``), ``batch_rows`` at a time; ``pair_side``
    null and ``weight`` 1 where the file predates them."""
    filesystem, path = storage.filesystem(uri)
    parquet = pq.ParquetFile(filesystem.open_input_file(path))
    present = [c for c in TOKENIZED_COLUMNS if c in parquet.schema_arrow.names]
    for rows in parquet.iter_batches(batch_rows, columns=present):
        if "pair_side" not in present:
            rows = rows.append_column("pair_side", pa.nulls(rows.num_rows, pa.string()))
        if "weight" not in present:
            rows = rows.append_column("weight", pa.array(np.ones(rows.num_rows)))
        yield pa.RecordBatch.from_arrays(rows.select(TOKENIZED_COLUMNS).columns, schema=TOKENIZED_LISTS)


@dataclass(frozen=True)
class BinLayout:
    """Rows of a group in bin order, and where each bin starts in that order."""

    rows: np.ndarray  # row indices of the group table, bin after bin
    bin_starts: np.ndarray  # [num_bins + 1] offsets into ``rows``

    @property
    def num_bins(self) -> int:
        return len(self.bin_starts) - 1


def layout(bin_of: np.ndarray, lengths: np.ndarray, bin_order: np.ndarray) -> BinLayout:
    """Rows grouped by bin in ``bin_order`` (bin_order[k] = the packer's bin written k-th);
    within a bin, samples in the order the packer placed them (longest first, then row)."""
    position = np.empty(len(bin_order), np.int64)
    position[bin_order] = np.arange(len(bin_order))
    unpacked = len(bin_order)  # an unpacked row's (-1) new bin: after every bin, then dropped
    new_bin = np.append(position, unpacked)[bin_of]
    rows = np.lexsort((-lengths, new_bin))  # stable: equal lengths stay in row order
    counts = np.bincount(new_bin, minlength=unpacked + 1)[:unpacked]
    return BinLayout(rows=rows[: counts.sum()], bin_starts=np.concatenate([[0], np.cumsum(counts)]))


def build_bins(
    group_rows: pa.Table,
    lay: BinLayout,
    first_bin: int,
    end_bin: int,
    *,
    group: int,
    read_media: Callable[[dict], bytes] | None,
    share_files: bool = False,
) -> pa.RecordBatch:
    """Shard rows for bins [first_bin, end_bin) of ``lay`` (bins are never empty);
    ``read_media`` gives the bytes to embed of one media item (its TOKENIZED_MEDIA fields), the
    file's own where ``share_files``: then a bin embeds each file once
    (``schemas.shared_media_data``)."""
    lo, hi = lay.bin_starts[first_bin], lay.bin_starts[end_bin]
    taken = group_rows.take(pa.array(lay.rows[lo:hi])).combine_chunks()
    row_offsets = (lay.bin_starts[first_bin : end_bin + 1] - lo).astype(np.int64)
    num_bins = end_bin - first_bin
    lengths = taken.column("num_tokens").to_numpy().astype(np.int64)
    bin_index = owner_of_elements(np.diff(row_offsets))
    token_starts = np.concatenate([[0], np.cumsum(lengths)])  # of each row, within the shard
    bin_token_offsets = token_starts[row_offsets]
    start_in_bin = token_starts[:-1] - bin_token_offsets[bin_index]

    def per_bin(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(values, row_offsets[:-1]) if len(values) else np.zeros(0, values.dtype)

    def column(name: str) -> np.ndarray:
        return taken.column(name).to_numpy().astype(np.int64)

    bin_tokens = per_bin(lengths)
    image, video = per_bin(column("image_tokens")), per_bin(column("video_tokens"))
    columns = {
        "group": pa.array(np.full(num_bins, group, np.int32)),
        "bin": pa.array(np.arange(first_bin, end_bin, dtype=np.int32)),
        "input_ids": _rebase(taken.column("input_ids"), bin_token_offsets),
        "labels": _rebase(taken.column("labels"), bin_token_offsets),
        "cu_seqlens": _cu_seqlens(start_in_bin, bin_tokens, row_offsets),
        "sample_ids": pa.ListArray.from_arrays(
            pa.array(row_offsets.astype(np.int32)), taken.column("sample_id").chunk(0)
        ),
        "sample_datasets": pa.ListArray.from_arrays(
            pa.array(row_offsets.astype(np.int32)), taken.column("dataset").chunk(0)
        ),
        "sample_pair_sides": pa.ListArray.from_arrays(
            pa.array(row_offsets.astype(np.int32)), taken.column("pair_side").chunk(0)
        ),
        "sample_weights": pa.ListArray.from_arrays(
            pa.array(row_offsets.astype(np.int32)), taken.column("weight").chunk(0)
        ),
        "num_tokens": pa.array(bin_tokens.astype(np.int32)),
        "num_samples": pa.array(np.diff(row_offsets).astype(np.int32)),
        "image_tokens": pa.array(image.astype(np.int32)),
        "video_tokens": pa.array(video.astype(np.int32)),
        "supervised_tokens": pa.array(per_bin(column("supervised_tokens")).astype(np.int32)),
        "sum_sq_lengths": pa.array(per_bin(lengths * lengths)),
        "vision_patches": pa.array((image + video) * VISION_PATCHES_PER_TOKEN),
        "media": _bin_media(
            taken.column("media").chunk(0), row_offsets, start_in_bin, read_media, share_files
        ),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=schemas.SHARD)


def _rebase(lists: pa.ChunkedArray, offsets: np.ndarray) -> pa.ListArray:
    """Concatenate the lists of consecutive rows into one list per bin."""
    values = lists.chunk(0).flatten()
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)


def _cu_seqlens(start_in_bin: np.ndarray, bin_tokens: np.ndarray, row_offsets: np.ndarray) -> pa.ListArray:
    """Per bin: the start of each sample, then the bin's length ([0, l1, l1+l2, ..., total])."""
    num_bins = len(bin_tokens)
    ends_at = row_offsets[1:] + np.arange(num_bins)  # where each bin's closing entry goes
    values = np.empty(len(start_in_bin) + num_bins, np.int32)
    is_end = np.zeros(len(values), bool)
    is_end[ends_at] = True
    values[is_end] = bin_tokens
    values[~is_end] = start_in_bin
    offsets = row_offsets + np.arange(num_bins + 1)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def _bin_media(
    media: pa.ListArray,
    row_offsets: np.ndarray,
    start_in_bin: np.ndarray,
    read_media: Callable[[dict], bytes] | None,
    share_files: bool,
) -> pa.ListArray:
    """Each row's media moved into its bin: offsets shifted to the bin, sample index added, the
    bytes to embed (``_embedded``)."""
    counts = list_lengths(media)
    items = media.flatten()
    row_of_item = owner_of_elements(counts)
    bin_of_row = owner_of_elements(np.diff(row_offsets))
    sample_index = row_of_item - row_offsets[bin_of_row[row_of_item]]
    token_offset = items.field("token_offset").to_numpy(zero_copy_only=False) + start_in_bin[row_of_item]
    data = _embedded(items, bin_of_row[row_of_item], read_media, share_files)
    fields = dict(zip(schemas.TOKENIZED_MEDIA.names, items.flatten(), strict=True))
    fields.update(
        sample_index=pa.array(sample_index.astype(np.int32)),
        token_offset=pa.array(token_offset.astype(np.int32)),
        data=data,
    )
    structs = pa.StructArray.from_arrays(
        [fields[f.name].cast(f.type) for f in schemas.SHARD_MEDIA], fields=list(schemas.SHARD_MEDIA)
    )
    item_counts = np.add.reduceat(counts, row_offsets[:-1]) if len(counts) else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(item_counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), structs)


def _embedded(
    items: pa.StructArray,
    bin_of_item: np.ndarray,
    read_media: Callable[[dict], bytes] | None,
    share_files: bool,
) -> pa.Array:
    """Each item's bytes to embed (all null without ``read_media``: the shard references media);
    with ``share_files``, null for an item whose file an earlier item of its bin embeds
    (``schemas.shared_media_data`` gives it back)."""
    if read_media is None:
        return pa.nulls(len(items), pa.binary())
    seen: set[tuple[int, str]] = set()
    data = []
    for item, bin_ in zip(items.to_pylist(), bin_of_item.tolist(), strict=True):
        key = (bin_, item["uri"])
        data.append(None if share_files and key in seen else read_media(item))
        seen.add(key)
    return pa.array(data, pa.binary())


def list_lengths(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The length of each list in a list column, as int64."""
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def owner_of_elements(lengths: np.ndarray) -> np.ndarray:
    """For consecutive groups of ``lengths`` elements (the flattened values of a list column,
    the rows of consecutive bins), the index of the group each element belongs to."""
    return np.repeat(np.arange(len(lengths)), lengths)


@dataclass(frozen=True)
class WrittenShard:
    path: str  # relative to the packed/ directory
    rows: int
    samples: int
    tokens: int
    bytes: int
    sha256: str
    row_groups: int
    weighted_samples: int = 0  # samples whose loss weight is not 1


def write_shard(
    packed_root: str,
    relative_path: str,
    batches: Iterable[pa.RecordBatch],
    bins_per_row_group: int,
    storage: fs.Storage,
) -> WrittenShard:
    """Write one shard from ``batches`` (each at most one row group of bins; streamed, so a
    shard of large embedded media is never whole in memory). A file under its final name is
    always complete (``fs.atomic_output``); it is hashed on the way out."""
    rows = samples = tokens = weighted = 0
    with storage.atomic_output(fs.join(packed_root, relative_path)) as stream:
        sink = fs.HashingSink(stream)
        with pq.ParquetWriter(
            sink, schemas.SHARD, compression="zstd", write_statistics=False, store_schema=True
        ) as writer:
            for batch in batches:
                writer.write_table(pa.Table.from_batches([batch], schema=schemas.SHARD), bins_per_row_group)
                rows += batch.num_rows
                samples += int(pc.sum(batch.column("num_samples")).as_py() or 0)
                tokens += int(pc.sum(batch.column("num_tokens")).as_py() or 0)
                weights = pc.list_flatten(batch.column("sample_weights"))
                weighted += int(pc.sum(pc.not_equal(weights, 1.0)).as_py() or 0)
    return WrittenShard(
        path=relative_path,
        rows=rows,
        samples=samples,
        tokens=tokens,
        bytes=sink.size,
        sha256=sink.hexdigest(),
        row_groups=-(-rows // bins_per_row_group),
        weighted_samples=weighted,
    )
