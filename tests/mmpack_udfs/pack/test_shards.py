"""Building bin rows from tokenized rows: pure Arrow/numpy, no Spark."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmpack_udfs import schemas
from mmpack_udfs.io import fs
from mmpack_udfs.pack import shards
from mmpack_udfs.pack.ffd import first_fit_decreasing

IMAGE_PAD, VIDEO_PAD = 151655, 151656


def tokenized_rows(n: int, seed: int = 0) -> pa.Table:
    """Rows shaped like the tokenized table: random lengths, some with media items."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(1, 300))
        ids = rng.integers(0, 50_000, length).astype(np.int32)
        labels = np.where(rng.random(length) < 0.5, -100, ids).astype(np.int32)
        media = []
        for k in range(int(rng.integers(0, 3)) if length > 20 else 0):
            media.append(
                {
                    "kind": "image" if k % 2 == 0 else "video",
                    "uri": f"/media/{i}-{k}.jpg",
                    "width": 64,
                    "height": 48,
                    "grid_t": 1,
                    "grid_h": 4,
                    "grid_w": 4,
                    "resized_height": 56,
                    "resized_width": 56,
                    "token_offset": 3 + 8 * k,
                    "num_tokens": 4,
                    "frame_indices": [0, 1] if k % 2 else None,
                }
            )
        for m in media:  # a span holds its pad id (vision embeddings = pad tokens); text never does
            span = slice(m["token_offset"], m["token_offset"] + m["num_tokens"])
            ids[span] = IMAGE_PAD if m["kind"] == "image" else VIDEO_PAD
            labels[span] = -100
        rows.append(
            {
                "sample_id": f"s{i:04d}",
                "dataset": "d",
                "input_ids": ids.tolist(),
                "labels": labels.tolist(),
                "num_tokens": length,
                "image_tokens": 4 * sum(m["kind"] == "image" for m in media),
                "video_tokens": 4 * sum(m["kind"] == "video" for m in media),
                "supervised_tokens": int((labels != -100).sum()),
                "media": media,
                "weight": (1.0, 0.5, 2.0)[i % 3],
            }
        )
    schema = pa.schema([schemas.TOKENIZED.field(c) for c in shards.TOKENIZED_COLUMNS])
    return pa.Table.from_pylist(rows, schema=schema)


def decode(batch: pa.RecordBatch) -> dict[str, dict]:
    """Split bin rows back into samples: sample id → its tokens, labels and media."""
    samples = {}
    for row in batch.to_pylist():
        cu = row["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == row["num_tokens"] == len(row["input_ids"]) == len(row["labels"])
        assert row["sum_sq_lengths"] == sum((b - a) ** 2 for a, b in itertools.pairwise(cu))
        for i, sid in enumerate(row["sample_ids"]):
            media = []
            for m in schemas.shared_media_data(row["media"]):
                if m["sample_index"] == i:
                    m = dict(m)
                    m["token_offset"] -= cu[i]
                    media.append(m)
            samples[sid] = {
                "input_ids": row["input_ids"][cu[i] : cu[i + 1]],
                "labels": row["labels"][cu[i] : cu[i + 1]],
                "media": media,
                "weight": row["sample_weights"][i],
            }
    return samples


@pytest.mark.parametrize("bins_per_shard", [1, 3, 1000])
def test_bins_decode_back_to_exactly_the_rows(bins_per_shard):
    rows = tokenized_rows(200)
    lengths = rows.column("num_tokens").to_numpy().astype(np.int64)
    packing = first_fit_decreasing(lengths, 1000)
    order = np.random.default_rng(1).permutation(packing.num_bins)
    lay = shards.layout(packing.bin_of, lengths, order)
    decoded = {}
    for first in range(0, lay.num_bins, bins_per_shard):
        end = min(first + bins_per_shard, lay.num_bins)
        batch = shards.build_bins(
            rows, lay, first, end, group=3, read_media=lambda item: item["uri"].encode()
        )
        assert batch.schema == schemas.SHARD
        assert (batch.column("num_tokens").to_numpy() <= 1000).all()
        assert batch.column("group").to_pylist() == [3] * (end - first)
        decoded.update(decode(batch))
    expected = {r["sample_id"]: r for r in rows.to_pylist()}
    assert decoded.keys() == expected.keys()
    for sid, got in decoded.items():
        want = expected[sid]
        assert got["input_ids"] == want["input_ids"] and got["labels"] == want["labels"]
        assert got["weight"] == want["weight"]
        assert len(got["media"]) == len(want["media"])
        for g, w in zip(got["media"], want["media"], strict=True):
            assert g["data"] == w["uri"].encode()
            assert {k: g[k] for k in w} == w


@pytest.mark.parametrize("share_files", [True, False])
def test_a_bin_embeds_each_file_once_and_every_item_reads_its_bytes(share_files):
    """Samples whose items name the same few files (a video and its own audio track, a pair's two
    sides): with ``share_files`` a bin holds each file's bytes once, and ``shared_media_data``
    gives every item its file's; without (prepared patches, which differ per item) each item holds
    its own."""
    rows = tokenized_rows(80, seed=4).to_pylist()
    for i, row in enumerate(rows):
        for k, item in enumerate(row["media"]):
            item["uri"] = f"/media/shared-{(i + k) % 3}"
    schema = pa.schema([schemas.TOKENIZED.field(c) for c in shards.TOKENIZED_COLUMNS])
    table = pa.Table.from_pylist(rows, schema=schema)
    lengths = table.column("num_tokens").to_numpy().astype(np.int64)
    packing = first_fit_decreasing(lengths, 1500)
    lay = shards.layout(packing.bin_of, lengths, np.arange(packing.num_bins))
    read = lambda item: item["uri"].encode() * 1000  # noqa: E731
    batch = shards.build_bins(table, lay, 0, lay.num_bins, group=0, read_media=read, share_files=share_files)
    stored = 0
    for row in batch.to_pylist():
        embedded = [m["uri"] for m in row["media"] if m["data"] is not None]
        assert len(set(embedded)) == len({m["uri"] for m in row["media"]})  # every file at least once
        if share_files:
            assert len(embedded) == len(set(embedded))  # and only once
        else:
            assert len(embedded) == len(row["media"])
        stored += len(embedded)
    items = sum(len(r["media"]) for r in rows)
    assert stored < items if share_files else stored == items
    for got in decode(batch).values():
        assert all(m["data"] == m["uri"].encode() * 1000 for m in got["media"])
    from loader.dataset import _MediaColumn  # the loader reads the bins the same way

    for views in (False, True):
        column = _MediaColumn(batch.column("media"), views=views)
        for row in range(batch.num_rows):
            assert all(bytes(m["data"]) == m["uri"].encode() * 1000 for m in column.row(row))


def test_bins_follow_the_given_order_and_keep_per_bin_figures():
    rows = tokenized_rows(60, seed=2)
    lengths = rows.column("num_tokens").to_numpy().astype(np.int64)
    packing = first_fit_decreasing(lengths, 700)
    order = np.arange(packing.num_bins)[::-1]
    lay = shards.layout(packing.bin_of, lengths, order)
    batch = shards.build_bins(rows, lay, 0, lay.num_bins, group=0, read_media=None)
    ids = rows.column("sample_id").to_pylist()
    for k, row in enumerate(batch.to_pylist()):
        members = sorted(ids[i] for i in np.flatnonzero(packing.bin_of == order[k]))
        assert sorted(row["sample_ids"]) == members
        assert row["num_samples"] == len(members)
        assert all(m["data"] is None for m in row["media"])
        assert row["vision_patches"] == 4 * (row["image_tokens"] + row["video_tokens"])


def test_write_shard_reports_the_bytes_it_wrote(tmp_path):
    rows = tokenized_rows(30)
    lengths = rows.column("num_tokens").to_numpy().astype(np.int64)
    packing = first_fit_decreasing(lengths, 500)
    lay = shards.layout(packing.bin_of, lengths, np.arange(packing.num_bins))
    batch = shards.build_bins(rows, lay, 0, lay.num_bins, group=0, read_media=None)
    written = shards.write_shard(str(tmp_path), "shards/x/g00000-00000.parquet", [batch], 2, fs.LOCAL)
    path = tmp_path / written.path
    data = path.read_bytes()
    assert written.bytes == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()
    assert written.rows == lay.num_bins and written.samples == 30 and written.tokens == lengths.sum()
    assert pq.ParquetFile(path).metadata.num_row_groups == written.row_groups == -(-lay.num_bins // 2)
    assert not list(path.parent.glob(".*"))  # the temporary file was renamed


@pytest.mark.parametrize("unpacked", [0, 5])
def test_layout_orders_each_bin_longest_first_then_by_row(unpacked):
    """Bins in the given order, each longest first and equal lengths by row; unpacked rows (-1)
    nowhere (the pack stage packs every row: that path sorts without copies)."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 6, 80)
    bin_of = rng.integers(0, 9, 80)
    bin_of[rng.choice(80, unpacked, replace=False)] = -1
    order = rng.permutation(9)
    lay = shards.layout(bin_of, lengths, order)
    expected = [r for b in order for r in sorted(np.flatnonzero(bin_of == b), key=lambda r: (-lengths[r], r))]
    assert lay.rows.tolist() == expected
    assert np.diff(lay.bin_starts).tolist() == [int((bin_of == b).sum()) for b in order]


@pytest.mark.parametrize(("start", "length"), [(0, 40), (7, 20), (39, 1), (13, 0)])
def test_token_columns_cross_the_jvm_as_their_bytes_and_come_back_the_same(start, length):
    ids = tokenized_rows(40).column("input_ids").combine_chunks()
    ids = pa.concat_arrays([ids, pa.array([[], [5]], ids.type)]).slice(start, length)  # empty lists too
    as_bytes = shards.lists_as_bytes(ids)
    assert as_bytes.to_pylist() == [np.array(x, "<i4").tobytes() for x in ids.to_pylist()]
    assert shards.bytes_as_lists(as_bytes).equals(ids)
    if length > 2:
        assert shards.bytes_as_lists(as_bytes.slice(2)).equals(ids.slice(2))


def test_tokenized_files_are_read_with_the_columns_older_tables_lack(tmp_path):
    """A Parquet file of an older tokenized table (no pair_side, no weight) reads with pair_side
    null and weight 1, as a newer one's rows; rows_as_lists gives the token columns back."""
    rows = tokenized_rows(30).select(shards.TOKENIZED_COLUMNS)
    pq.write_table(rows.slice(0, 20), tmp_path / "new.parquet")
    pq.write_table(rows.slice(20).drop_columns(["pair_side", "weight"]), tmp_path / "old.parquet")
    listing = pa.RecordBatch.from_pylist(
        [{"uris": [str(tmp_path / "new.parquet"), str(tmp_path / "old.parquet")]}]
    )
    batches = list(shards.read_tokenized_files(iter([listing]), fs.LOCAL, batch_rows=8))
    assert all(b.schema.equals(shards.TOKENIZED_ROWS) for b in batches)
    got = pa.Table.from_batches([shards.rows_as_lists(b) for b in batches])
    assert got.column("input_ids").to_pylist() == rows.column("input_ids").to_pylist()
    assert got.column("labels").to_pylist() == rows.column("labels").to_pylist()
    assert got.column("pair_side").to_pylist()[20:] == [None] * 10
    assert got.column("weight").to_pylist() == rows.column("weight").to_pylist()[:20] + [1.0] * 10
