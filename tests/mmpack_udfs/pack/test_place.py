"""The pack's driver plan and shard tasks, without Spark: every row placed once, row groups
stratified by cost, shards that do not depend on how rows arrive."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from mmpack_udfs import schemas
from mmpack_udfs.config import load_config
from mmpack_udfs.io import fs
from mmpack_udfs.io import tables as delta
from mmpack_udfs.pack import costs, shards
from mmpack_udfs.pack import stage as pack
from tests.mmpack_udfs.pack.test_shards import tokenized_rows

SETTINGS = pack.PackSettings.from_config(
    load_config(None, ["pack.budget=900", "pack.bins_per_shard=8", "pack.bins_per_row_group=4",
                       "pack.embed_media=false"])
)  # fmt: skip


def sorted_rows(n: int = 160, seed: int = 4) -> pa.Table:
    rows = tokenized_rows(n, seed=seed)
    return rows.take(pc.sort_indices(rows, [("sample_id", "ascending")]))


def test_every_row_has_one_place_and_bins_keep_the_budget():
    rows = sorted_rows()
    placement = pack.place(rows, SETTINGS)
    places = set(
        zip(placement.shard.tolist(), placement.bin_row.tolist(), placement.position.tolist(), strict=True)
    )
    assert len(places) == rows.num_rows and (placement.shard >= 0).all()
    lengths = rows.column("num_tokens").to_numpy()
    bins = placement.shard * SETTINGS.bins_per_shard + placement.bin_row
    assert np.bincount(bins, weights=lengths).max() <= SETTINGS.budget
    assert sum(placement.shard_bins) == len(np.unique(bins))
    assert all(b == SETTINGS.bins_per_shard for b in placement.shard_bins[:-1])


def test_row_groups_are_stratified_by_cost():
    overrides = ["pack.budget=900", "pack.bins_per_row_group=4", "balance.cost_model.qwen2_vl.vision_patch=0",
                 "balance.cost_model.qwen2_vl.vision_pair=0"]  # fmt: skip
    settings = pack.PackSettings.from_config(load_config(None, overrides))  # LLM cost only: one axis
    rows = sorted_rows(600, seed=2)
    placement = pack.place(rows, settings)
    bins = placement.shard * settings.bins_per_shard + placement.bin_row
    lengths = rows.column("num_tokens").to_numpy().astype(float)
    model = settings.cost_model
    llm = model.llm_token * np.bincount(bins, weights=lengths) + model.llm_pair * np.bincount(
        bins, lengths**2
    )
    groups = np.sort(llm[: len(llm) // 4 * 4].reshape(-1, 4), axis=1)  # full row groups, as written
    neighbours = np.abs(np.diff(groups, axis=0)).mean()
    shuffled = np.sort(np.random.default_rng(0).permutation(llm)[: len(groups) * 4].reshape(-1, 4), axis=1)
    assert neighbours < 0.5 * np.abs(np.diff(shuffled, axis=0)).mean()  # neighbours are near-copies
    spread = groups[:, -1] - groups[:, 0]
    assert spread.min() > 0.9 * np.subtract(*np.quantile(llm, [0.75, 0.25]))  # each spans the strata


def test_a_shard_does_not_depend_on_how_its_rows_arrive(tmp_path):
    rows = sorted_rows()
    placement = pack.place(rows, SETTINGS)  # rows are the counts table too: same order
    placed = rows
    for name in ("shard", "bin_row", "position"):
        placed = placed.append_column(name, pa.array(getattr(placement, name).astype(np.int32)))
    mine = placed.filter(pc.equal(placed["shard"], 0))
    shuffles = (np.random.default_rng(seed).permutation(mine.num_rows) for seed in (0, 1))
    arrivals = [[mine.take(pa.array(order))] for order in shuffles]
    in_order = mine.sort_by([("bin_row", "ascending"), ("position", "ascending")])
    batches = in_order.to_batches(max_chunksize=7)  # as Spark hands over the sorted partition
    groups = [rows for _, rows in pack.rows_by_row_group(iter(batches), SETTINGS.bins_per_row_group)]
    assert len(groups) == -(-SETTINGS.bins_per_shard // SETTINGS.bins_per_row_group) > 1
    arrivals.append(groups)
    results = []
    for n, tables in enumerate(arrivals):
        result = pack.write_placed_shard(tables, 0, SETTINGS, str(tmp_path / str(n)), "shards/t", fs.LOCAL)
        results.append(result.to_pylist()[0])
    assert len({r["written"]["sha256"] for r in results}) == 1
    assert {r["rows_in"] for r in results} == {mine.num_rows}
    assert results[0]["written"]["rows"] == SETTINGS.bins_per_shard
    index = costs.from_ipc(results[0]["costs"])
    assert index.num_rows == SETTINGS.bins_per_shard


def test_rows_by_row_group_holds_one_row_group_at_a_time_across_batch_boundaries():
    """write_shards' input: a partition's rows sorted by (shard, bin_row), in batches that cut anywhere."""

    def batch(shards: list[int], bins: list[int]) -> pa.RecordBatch:
        return pa.record_batch({"shard": pa.array(shards, pa.int64()), "bin_row": pa.array(bins, pa.int64())})

    batches = [
        batch([0, 0, 0, 1, 1], [0, 1, 2, 0, 0]),
        batch([], []),
        batch([1, 1, 3], [1, 4, 0]),
        batch([9], [7]),
    ]
    runs = [(shard, rows["bin_row"].to_pylist()) for shard, rows in pack.rows_by_row_group(iter(batches), 2)]
    assert runs == [(0, [0, 1]), (0, [2]), (1, [0, 0, 1]), (1, [4]), (3, [0]), (9, [7])]
    assert list(pack.rows_by_row_group(iter([]), 2)) == []


def test_the_placement_reaches_the_tasks_whole_in_parts(tmp_path):
    """The Parquet parts the shard tasks read hold every item once, with its place and id."""
    rows = sorted_rows(50)
    placement = pack.place(rows, SETTINGS, copies=np.resize([1, 2, 0], rows.num_rows))
    parts = pack.write_placement_parts(placement, str(tmp_path / "placement"), fs.LOCAL)
    assert len(parts) == 1
    ids = rows.column("sample_id").to_pylist()
    places = (placement.shard.tolist(), placement.bin_row.tolist(), placement.position.tolist())
    expected = sorted(zip([ids[r] for r in placement.row], *places, strict=True))
    small = list(placement.parts(items_per_part=7))
    assert [t.num_rows for t in small[:-1]] == [7] * (len(small) - 1)
    for pieces in ([pq.read_table(p) for p in parts], small):
        whole = pa.concat_tables(pieces)
        assert whole.schema == pack.PLACEMENT
        assert sorted(zip(*whole.to_pydict().values(), strict=True)) == expected
    assert len(expected) == sum(np.resize([1, 2, 0], rows.num_rows))


def test_counts_hold_ids_past_two_gib_and_datasets_as_codes(tmp_path):
    """read_counts gives ids 64-bit offsets (100 M ids of 32 hex digits pass the 2 GiB of a
    string array: bench_pack_plan) and datasets as dictionary codes, sorted by sample_id."""
    rows = tokenized_rows(40, seed=6)
    rows = rows.append_column("parent_id", rows["sample_id"]).append_column("text_tokens", rows["num_tokens"])
    datasets = pa.array(["a", "b", "c", "b"] * 10)
    rows = rows.set_column(rows.schema.get_field_index("dataset"), "dataset", datasets)
    rows = rows.select(schemas.TOKENIZED.names).cast(schemas.TOKENIZED)
    uri = schemas.table_uri(str(tmp_path), "tokenized")
    written = [delta.write_part(uri, f"part-{k}.parquet", [rows.slice(k * 20, 20).to_batches()[0]],
                                schemas.TOKENIZED, fs.LOCAL) for k in range(2)]  # fmt: skip
    delta.commit(uri, schemas.TOKENIZED, written, run_id="t", mode="overwrite", rows=40, storage=fs.LOCAL)
    counts = pack.read_counts(uri, delta.snapshot(uri, fs.LOCAL), fs.LOCAL)
    assert counts.schema.field("sample_id").type == pa.large_string()
    assert pa.types.is_dictionary(counts.schema.field("dataset").type)
    assert counts.column("sample_id").to_pylist() == sorted(rows.column("sample_id").to_pylist())
    by_id = dict(zip(rows.column("sample_id").to_pylist(), rows.column("dataset").to_pylist(), strict=True))
    assert counts.column("dataset").to_pylist() == [by_id[i] for i in counts.column("sample_id").to_pylist()]


ONE_SHARD = pack.PackSettings.from_config(
    load_config(
        None,
        [
            "pack.budget=900",
            "pack.bins_per_shard=1000",
            "pack.bins_per_row_group=4",
            "pack.embed_media=false",
        ],
    )
)


def tokenized_files(rows: pa.Table, folder, files: int = 3) -> pa.RecordBatch:
    """``rows`` as tokenized Parquet files under ``folder``: the one row naming them (``uris``)."""
    folder.mkdir()
    uris = []
    for k, part in enumerate(np.array_split(np.arange(rows.num_rows), files)):
        uris.append(str(folder / f"part-{k}.parquet"))
        pq.write_table(rows.take(pa.array(part)), uris[-1], row_group_size=20)
    return pa.record_batch({"uris": pa.array([uris], pa.list_(pa.string()))})


def joined_as_spark_does(listing: pa.RecordBatch, parts: list[str]) -> list[pa.RecordBatch]:
    """The shard tasks' input on the join path: each placed item's row (read as bytes), sorted
    by (shard, bin_row, position), in batches cut anywhere."""
    read = pa.Table.from_batches(list(shards.read_tokenized_files(iter([listing]), fs.LOCAL)))
    placed = pa.concat_tables(pq.read_table(part) for part in parts).to_pylist()
    row_of = {sample_id: i for i, sample_id in enumerate(read.column("sample_id").to_pylist())}
    joined = read.take(pa.array([row_of[item["sample_id"]] for item in placed]))
    for name in ("shard", "bin_row", "position"):
        joined = joined.append_column(name, pa.array([item[name] for item in placed], pa.int32()))
    joined = joined.sort_by([("shard", "ascending"), ("bin_row", "ascending"), ("position", "ascending")])
    return joined.to_batches(max_chunksize=7)


def test_one_task_writes_the_shard_that_the_join_writes(tmp_path):
    """A run of one shard, written by one task from the tokenized files: the same bytes and
    result as the shard tasks after Spark's join; copies of a row (weights) and rows left out
    of the run (weight 0) as well."""
    rows = sorted_rows(160)
    placement = pack.place(rows, ONE_SHARD, copies=np.resize([1, 2, 0], rows.num_rows))
    assert pack.in_one_task(placement) and placement.items > rows.num_rows * 0.9
    listing = tokenized_files(rows, tmp_path / "tokenized")
    parts = pack.write_placement_parts(placement, str(tmp_path / "placement"), fs.LOCAL)
    results = {}
    for way in ("one task", "join"):
        root = tmp_path / way.replace(" ", "-")
        if way == "one task":
            written = pack.write_one_shard(iter([listing]), parts, ONE_SHARD, str(root), "shards/t", fs.LOCAL)
        else:
            batches = joined_as_spark_does(listing, parts)
            written = pack.write_shards(iter(batches), ONE_SHARD, str(root), "shards/t", fs.LOCAL)
        [result] = [row for batch in written for row in batch.to_pylist()]
        results[way] = {**result, "bytes": (root / "shards/t/s00000.parquet").read_bytes(), "seconds": 0}
    assert results["one task"] == results["join"]
    assert results["join"]["rows_in"] == placement.items
    assert results["join"]["written"]["rows"] == placement.shard_bins[0] > ONE_SHARD.bins_per_row_group


def test_one_task_refuses_a_placement_of_rows_the_files_lack(tmp_path):
    rows = sorted_rows(40)
    placement = pack.place(rows, ONE_SHARD)
    listing = tokenized_files(rows.slice(0, 30), tmp_path / "tokenized", files=1)
    parts = pack.write_placement_parts(placement, str(tmp_path / "placement"), fs.LOCAL)
    with pytest.raises(pack.PackError, match="names 10 rows that the tokenized files do not hold"):
        list(pack.write_one_shard(iter([listing]), parts, ONE_SHARD, str(tmp_path / "out"), "s", fs.LOCAL))


def test_one_task_writes_only_a_run_of_one_small_shard():
    rows = sorted_rows(160)
    assert pack.in_one_task(pack.place(rows, ONE_SHARD))
    assert not pack.in_one_task(pack.place(rows, SETTINGS))  # eight bins a shard: several shards
    one = pack.place(rows, ONE_SHARD)
    assert not pack.in_one_task(dataclasses.replace(one, tokens=pack.ONE_TASK_TOKENS + 1))
