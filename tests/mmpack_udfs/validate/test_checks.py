"""Checking shards against their manifest entry and bins against their own figures: no Spark."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mmpack_udfs.io import fs
from mmpack_udfs.pack import shards
from mmpack_udfs.pack.ffd import first_fit_decreasing
from mmpack_udfs.validate.stage import bin_problems, check_shard, manifest_problems
from tests.mmpack_udfs.pack.test_shards import tokenized_rows

BUDGET = 1000


def packed_bins(n: int = 120) -> pa.Table:
    rows = tokenized_rows(n)
    lengths = rows.column("num_tokens").to_numpy().astype(np.int64)
    packing = first_fit_decreasing(lengths, BUDGET)
    lay = shards.layout(packing.bin_of, lengths, np.arange(packing.num_bins))
    batch = shards.build_bins(rows, lay, 0, lay.num_bins, group=0, read_media=None)
    return pa.Table.from_batches([batch])


def replace(bins: pa.Table, column: str, row: int, value) -> pa.Table:
    values = bins.column(column).to_pylist()
    values[row] = value
    index = bins.schema.get_field_index(column)
    return bins.set_column(index, bins.schema.field(column), pa.array(values, bins.schema.field(column).type))


def test_pad_ids_outside_spans_or_other_ids_inside_are_named():
    bins = packed_bins()
    row = int(np.flatnonzero(bins["image_tokens"].to_numpy())[0])
    ids, media = bins["input_ids"][row].as_py(), bins["media"][row].as_py()
    span = next(m for m in media if m["kind"] == "image")
    pad = ids[span["token_offset"]]
    outside = next(i for i in range(len(ids)) if ids[i] != pad)  # text written as a pad token
    stray = replace(bins, "input_ids", row, [pad if i == outside else t for i, t in enumerate(ids)])
    assert any(
        "pad id outside every media span" in p and f"(rows {row})" in p for p in bin_problems(stray, BUDGET)
    )
    inside = span["token_offset"] + span["num_tokens"] - 1
    mixed = replace(bins, "input_ids", row, [7 if i == inside else t for i, t in enumerate(ids)])
    assert any(
        "holds ids other than its pad id" in p and f"(rows {row})" in p for p in bin_problems(mixed, BUDGET)
    )


def test_well_formed_bins_have_no_problems():
    assert bin_problems(packed_bins(), BUDGET) == []


@pytest.mark.parametrize(
    ("column", "change", "message"),
    [
        ("input_ids", lambda v: v[:-1], "input_ids: length != num_tokens"),
        ("labels", lambda v: [*v, -100], "labels: length != num_tokens"),
        ("sample_ids", lambda v: [*v, "extra"], "sample_ids: length != num_samples"),
        ("cu_seqlens", lambda v: [1, *v[1:]], "cu_seqlens: does not start at 0"),
        ("cu_seqlens", lambda v: [0, 0, *v[1:-1]] if len(v) > 2 else [0, 0], "not strictly increasing"),
        ("sum_sq_lengths", lambda v: v + 1, "sum_sq_lengths != sum of squared"),
        ("labels", lambda v: [v[0] + 1 if v[0] != -100 else 7, *v[1:]], "supervised label differs"),
        ("supervised_tokens", lambda v: v + 1, "supervised_tokens != labels"),
        ("image_tokens", lambda v: v + 4, "image_tokens != the image spans"),
    ],
)
def test_each_broken_invariant_is_named_with_its_bin(column, change, message):
    bins = packed_bins()
    row = 3 if column != "image_tokens" else int(np.flatnonzero(bins["image_tokens"].to_numpy())[0])
    broken = replace(bins, column, row, change(bins.column(column)[row].as_py()))
    problems = bin_problems(broken, BUDGET)
    assert any(message in p and f"(rows {row})" in p for p in problems), problems


def test_bins_over_the_budget_and_media_outside_their_bin():
    bins = packed_bins()
    assert any("over the budget (100)" in p for p in bin_problems(bins, 100))
    row = int(np.flatnonzero(pc.list_value_length(bins["media"]).to_numpy())[0])
    media = bins["media"][row].as_py()
    media[0]["token_offset"] = bins["num_tokens"][row].as_py()
    assert any(
        "a span lies outside its bin" in p for p in bin_problems(replace(bins, "media", row, media), BUDGET)
    )


@pytest.fixture
def written(tmp_path):
    bins = packed_bins(40)
    shard = shards.write_shard(str(tmp_path), "shards/t/g0-0.parquet", bins.to_batches(), 4, fs.LOCAL)
    entry = {
        k: getattr(shard, k) for k in ("path", "rows", "samples", "tokens", "bytes", "sha256", "row_groups")
    }
    return tmp_path, entry, bins


def test_a_shard_that_matches_its_entry_yields_its_sample_ids(written):
    root, entry, bins = written
    problems, ids = check_shard(str(root), entry, BUDGET, fs.LOCAL)
    assert problems == []
    assert sorted(ids.to_pylist()) == sorted(pc.list_flatten(bins["sample_ids"]).to_pylist())


def test_a_changed_or_missing_shard_is_reported_not_raised(written):
    root, entry, _ = written
    path = root / entry["path"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    problems, ids = check_shard(str(root), entry, BUDGET, fs.LOCAL)
    assert len(ids) == 0 and "sha256 " + hashlib.sha256(data).hexdigest() in problems[0]
    path.unlink()
    assert check_shard(str(root), entry, BUDGET, fs.LOCAL)[0] == [f"{entry['path']}: missing"]


def test_entry_figures_that_disagree_with_the_shard(written):
    root, entry, _ = written
    problems, _ = check_shard(str(root), {**entry, "rows": entry["rows"] + 1, "tokens": 5}, BUDGET, fs.LOCAL)
    assert [p.split(": ", 1)[1].split(" is ")[0] for p in problems] == ["rows", "tokens"]


def test_manifest_totals_must_add_up():
    shard = {"path": "a", "rows": 2, "samples": 5, "tokens": 100, "bytes": 10}
    totals = {"shards": 2, "bins": 4, "samples": 10, "tokens": 200, "bytes": 20}
    assert manifest_problems({"shards": [shard, {**shard, "path": "b"}], "totals": totals}) == []
    problems = manifest_problems({"shards": [shard, shard], "totals": {**totals, "tokens": 199}})
    assert problems == [
        "manifest: totals.tokens is 199 but its shards add up to 200",
        "manifest: a shard path is listed twice",
    ]
