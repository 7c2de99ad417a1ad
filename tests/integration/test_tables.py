"""Delta table I/O through delta-rs with Spark writing the files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import write_deltalake

from mmpack_udfs.io import fs, tables
from mmpack_udfs.normalize import sample_runs
from mmpack_udfs.schemas import SAMPLES

pytestmark = pytest.mark.spark

SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("n", pa.int64())])


def frame(spark, n, offset=0):
    return spark.createDataFrame([(f"k{i:04d}", i) for i in range(offset, offset + n)], "id string, n long")


def write(df, uri, run_id, mode="overwrite", storage=fs.LOCAL, rows_per_file=40):
    return tables.write_table(
        df,
        uri,
        SCHEMA,
        run_id=run_id,
        mode=mode,
        sort_by=["id"],
        rows_per_file=rows_per_file,
        storage=storage,
    )


def test_overwrite_append_and_idempotent_run_ids(spark, tmp_path):
    uri = str(tmp_path / "t")
    first = write(frame(spark, 100), uri, "r1")
    assert (first.version, first.rows, first.files, first.skipped) == (0, 100, 3, False)
    assert write(frame(spark, 100), uri, "r1").skipped  # same run id: nothing committed
    assert tables.open_table(uri).version() == 0
    appended = write(frame(spark, 10, offset=100), uri, "r2", mode="append")
    assert appended.version == 1 and tables.read_arrow(uri).num_rows == 110
    assert write(frame(spark, 10, offset=100), uri, "r2", mode="append").skipped
    replaced = write(frame(spark, 5), uri, "r3")
    assert replaced.version == 2 and tables.read_arrow(uri).num_rows == 5
    # r1 was overwritten since, so running it again must restore its content
    again = write(frame(spark, 100), uri, "r1")
    assert not again.skipped and tables.read_arrow(uri).num_rows == 100
    got = tables.read_arrow(uri)
    assert got.schema.equals(SCHEMA) and sorted(got.column("id").to_pylist()) == [
        f"k{i:04d}" for i in range(100)
    ]


def test_samples_merged_from_runs_are_a_spark_write_of_the_first_rows(spark, tmp_path):
    """normalize's samples write (sorted runs merged by id range, each id's first row kept)
    gives, byte for byte, the file Spark's write of the unique first rows gives: sorted by
    sample_id, in row groups of Spark's Arrow batch size, duplicates across runs, spills and
    batch boundaries included."""
    from tests.mmpack_udfs.normalize.test_sample_runs import first_rows, samples, write_runs

    rows = samples(400, 170)
    runs = write_runs(rows, str(tmp_path / "runs"), run_rows=60)
    previous = spark.conf.get(tables.BATCH_ROWS_KEY)
    spark.conf.set(tables.BATCH_ROWS_KEY, "7")
    try:
        merged, kept = sample_runs.write_samples(
            spark, runs, len(rows), str(tmp_path / "merged"), rows_per_file=1000, run_id="r",
            mode="overwrite", existing=[], storage=fs.LOCAL,
        )  # fmt: skip
        unique = first_rows(rows)
        frame = spark.createDataFrame(pa.Table.from_pylist(unique, schema=SAMPLES))
        written = tables.write_table(
            frame, str(tmp_path / "unique"), SAMPLES, run_id="r", mode="overwrite", sort_by=["sample_id"],
            rows_per_file=1000,
        )  # fmt: skip
    finally:
        spark.conf.set(tables.BATCH_ROWS_KEY, previous)
    assert (merged.rows, merged.files) == (170, 1) == (written.rows, written.files)
    assert kept == {d: sum(r["dataset"] == d for r in unique) for d in ("a", "b")}
    (a,), (b,) = (
        tables.data_files(str(tmp_path / "merged"))[1],
        tables.data_files(str(tmp_path / "unique"))[1],
    )
    assert Path(a).read_bytes() == Path(b).read_bytes()
    groups = pq.ParquetFile(a).metadata
    assert [groups.row_group(i).num_rows for i in range(groups.num_row_groups)] == [7] * 24 + [2]
    again, kept_again = sample_runs.write_samples(
        spark, [], 0, str(tmp_path / "merged"), rows_per_file=1000, run_id="r", mode="overwrite",
        existing=[], storage=fs.LOCAL,
    )  # fmt: skip
    assert again.skipped and kept_again == kept  # a re-run finds the commit and its counts


def test_empty_frame_makes_an_empty_table(spark, tmp_path):
    uri = str(tmp_path / "empty")
    result = write(frame(spark, 0), uri, "e")
    assert (result.rows, result.files) == (0, 0)
    assert tables.read_table(spark, uri).count() == 0


def test_spark_reads_through_the_delta_file_list(spark, tmp_path):
    uri = str(tmp_path / "t")
    write(frame(spark, 50), uri, "a")
    write(frame(spark, 7), uri, "b")  # overwrite: old files stay on disk, not in the table
    assert len(list((tmp_path / "t").glob("*.parquet"))) > len(tables.data_files(uri)[1])
    assert tables.read_table(spark, uri).count() == 7


def test_tables_with_column_mapping_are_refused(spark, tmp_path):
    uri = str(tmp_path / "cm")
    write_deltalake(uri, pa.table({"id": ["a"]}), configuration={"delta.columnMapping.mode": "name"})
    with pytest.raises(tables.TableError, match="column mapping"):
        tables.read_table(spark, uri)


def test_deletion_vectors_enabled_but_unused_is_fine(spark, tmp_path):
    uri = str(tmp_path / "dv")
    write_deltalake(uri, pa.table({"id": ["a", "b"]}), configuration={"delta.enableDeletionVectors": "true"})
    assert tables.read_table(spark, uri).count() == 2


def test_files_with_deletion_vectors_are_refused():
    class TableWithDeletionVectors:
        def metadata(self):
            return type("M", (), {"configuration": {}})()

        def protocol(self):
            return type("P", (), {"reader_features": ["deletionVectors"]})()

        def deletion_vectors(self):
            return pa.table({"filepath": ["f.parquet"], "selection_vector": [[True, False]]})

    with pytest.raises(tables.TableError, match="deletion vectors"):
        tables.check_readable(TableWithDeletionVectors(), "t")


def test_missing_table_is_a_clear_error(spark, tmp_path):
    with pytest.raises(tables.TableError, match="no Delta table"):
        tables.read_table(spark, str(tmp_path / "nothing"))


def test_tables_on_s3(spark, s3_bucket):
    endpoint, bucket = s3_bucket
    storage = fs.Storage(fs.S3Options(endpoint_override=endpoint))
    uri = f"s3://{bucket}/tables/t"
    result = write(frame(spark, 60), uri, "s3run", storage=storage)
    assert (result.rows, result.files) == (60, 2)
    assert write(frame(spark, 60), uri, "s3run", storage=storage).skipped
    assert tables.read_arrow(uri, storage).num_rows == 60
    assert sorted(r.n for r in tables.read_table(spark, uri, storage).collect()) == list(range(60))


def test_roots_with_space_hash_and_non_ascii(spark, tmp_path):
    """delta-rs lists a table's files percent-encoded: they must be read as the paths they are."""
    uri = str(tmp_path / "out dir #1 ü" / "t")
    assert write(frame(spark, 50), uri, "r1").rows == 50
    files = tables.snapshot(uri).files
    assert files and all(" #1 ü" in f for f in files)
    assert tables.read_arrow(uri).num_rows == 50
    assert tables.read_table(spark, uri).count() == 50
