"""Samples as sorted runs, merged by id range (normalize/sample_runs.py), without Spark."""

from __future__ import annotations

import hashlib
import itertools
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack_udfs.io import fs, tables
from mmpack_udfs.normalize import sample_runs
from mmpack_udfs.schemas import SAMPLES

HEX = st.text("0123456789abcdef", min_size=0, max_size=40)


def samples(n: int, distinct: int, seed: int = 0) -> list[dict]:
    """``n`` sample rows over ``distinct`` ids (the rest duplicates), in a shuffled order."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        sid = hashlib.sha256(str(k % distinct).encode()).hexdigest()[:32]
        rows.append({
            "sample_id": sid, "dataset": rng.choice(["a", "b"]), "source_file": f"f{rng.randrange(3)}",
            "source_position": k, "system": None, "turns": [{"role": "user", "text": f"t{k}"}],
            "media": [], "rejected": None, "weight": 1.0,
        })  # fmt: skip
    rng.shuffle(rows)
    return rows


def write_runs(rows: list[dict], folder: str, tasks: int = 3, run_rows: int = 70) -> list[str]:
    """The rows dealt to ``tasks`` writers, each spilling runs of ``run_rows``."""
    uris = []
    for task in range(tasks):
        writer = sample_runs.RunWriter(folder, task, fs.LOCAL, run_rows=run_rows)
        mine = rows[task::tasks]
        for start in range(0, len(mine), 25):
            writer.add(pa.RecordBatch.from_pylist(mine[start : start + 25], schema=SAMPLES))
        uris += [uri for uri, _ in writer.close()]
    return uris


def first_rows(rows: list[dict]) -> list[dict]:
    """Each id's first row by (dataset, source_file, source_position), sorted by id."""
    best: dict[str, dict] = {}
    for row in rows:
        key = tuple(row[k] for k in sample_runs.FIRST_BY)
        if row["sample_id"] not in best or key < tuple(
            best[row["sample_id"]][k] for k in sample_runs.FIRST_BY
        ):
            best[row["sample_id"]] = row
    return [best[k] for k in sorted(best)]


def times_inside(ids: pa.Array, ranges) -> np.ndarray:
    """How many of ``ranges`` each id lies in."""
    return sum(np.asarray(sample_runs.in_range(ids, low, high)) for low, high in ranges)


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 40), st.lists(HEX, max_size=30))
def test_id_ranges_put_every_string_in_one_range_in_order(files, ids):
    ranges = sample_runs.id_ranges(files)
    assert len(ranges) == files and ranges[0][0] == "" and ranges[-1][1] is None
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert (times_inside(pa.array(ids, pa.string()), ranges) == 1).all()


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 40), st.integers(1, 9), st.lists(HEX, max_size=30))
def test_sub_ranges_cut_a_range_into_ordered_pieces(files, parts, ids):
    ids = pa.array(ids, pa.string())
    for low, high in sample_runs.id_ranges(files):
        pieces = sample_runs.sub_ranges(low, high, parts)
        assert pieces[0][0] == low and pieces[-1][1] == high and len(pieces) <= parts
        assert all(a[1] == b[0] and (a[1] is None or a[0] < a[1]) for a, b in itertools.pairwise(pieces))
        whole = np.asarray(sample_runs.in_range(ids, low, high)).astype(int)
        assert (times_inside(ids, pieces) == whole).all()


def test_runs_are_sorted_and_count_their_datasets(tmp_path):
    rows = samples(200, 150)
    writer = sample_runs.RunWriter(str(tmp_path), 7, fs.LOCAL, run_rows=80)
    writer.add(pa.RecordBatch.from_pylist(rows, schema=SAMPLES))
    runs = writer.close()
    assert [uri.rsplit("/", 1)[1] for uri, _ in runs] == ["run-00007-0000.parquet"]  # one add, one run
    table = pq.read_table(runs[0][0])
    keys = list(zip(*(table.column(k).to_pylist() for k in sample_runs.SORT_KEY), strict=True))
    assert keys == sorted(keys) and table.num_rows == 200
    assert runs[0][1] == {d: sum(r["dataset"] == d for r in rows) for d in ("a", "b")}
    assert pq.ParquetFile(runs[0][0]).metadata.num_row_groups == 1  # 200 rows: under RUN_GROUP_ROWS


def test_a_sorted_file_reads_only_the_row_groups_of_a_range(tmp_path):
    rows = sorted(samples(500, 500), key=lambda r: r["sample_id"])
    path = str(tmp_path / "sorted.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLES), path, row_group_size=50)
    source = sample_runs.SortedFile(path, fs.LOCAL)
    low, high = rows[120]["sample_id"], rows[180]["sample_id"]
    got = source.rows(low, high)
    assert got.column("sample_id").to_pylist() == [r["sample_id"] for r in rows[120:180]]
    groups = [g for g, (lo, hi) in enumerate(source.bounds) if hi >= low and lo < high]
    assert groups == [2, 3]  # rows 100-199: two of ten groups


def test_merged_ranges_hold_each_ids_first_row_once_in_order(tmp_path):
    rows = samples(600, 250)
    runs = write_runs(rows, str(tmp_path / "runs"))
    assert len(runs) > 3  # spilled
    merged = []
    for low, high in sample_runs.id_ranges(4):
        batches = sample_runs.merge_range(runs, low, high, [], fs.LOCAL, parts=3)
        part = pa.Table.from_batches(list(tables.first_rows(batches, ["sample_id"])), schema=SAMPLES)
        ids = part.column("sample_id").to_pylist()
        assert all(sample_runs.in_range(part.column("sample_id"), low, high).to_pylist())
        assert ids == sorted(set(ids))
        merged += part.to_pylist()
    assert merged == first_rows(rows)


def test_an_append_leaves_out_the_ids_the_table_has(tmp_path):
    rows = samples(300, 300)
    runs = write_runs(rows, str(tmp_path / "runs"))
    old = sorted(rows[:100], key=lambda r: r["sample_id"])
    existing = str(tmp_path / "existing.parquet")
    pq.write_table(pa.Table.from_pylist(old, schema=SAMPLES), existing, row_group_size=30)
    batches = sample_runs.merge_range(runs, "", None, [existing], fs.LOCAL, parts=2)
    got = pa.Table.from_batches(list(batches), schema=SAMPLES).column("sample_id").to_pylist()
    assert got == sorted(r["sample_id"] for r in rows[100:])
