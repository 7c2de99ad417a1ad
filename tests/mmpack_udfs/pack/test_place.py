"""The pack's driver plan and shard tasks, without Spark: every row placed once, row groups
stratified by cost, shards that do not depend on how rows arrive."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmpack_udfs.config import load_config
from mmpack_udfs.io import fs
from mmpack_udfs.pack import costs
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
