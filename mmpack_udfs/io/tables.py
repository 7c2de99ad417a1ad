"""Delta tables through delta-rs: executors write Parquet, the driver commits once.

There are no Delta jars here, so Spark never writes ``format("delta")``. Instead:

1. each Spark task writes its partition as one Parquet file with pyarrow, under a name
   made from the run id and the partition index (a retried task rewrites the same file);
2. the driver commits all files as one Delta transaction carrying an application
   transaction id ``mmpack:<run id>``; a run id that is already in the log is never
   committed again (idempotent re-runs);
3. readers go through the Delta file list, refusing tables with deletion vectors or
   column mapping, which a plain Parquet read would get wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Schema, Transaction
from deltalake.transaction import AddAction, create_table_with_add_actions

from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs
from mmpack_udfs.io.memory import releasing
from mmpack_udfs.io.spark import one_task_per_row

BATCH_ROWS_KEY = "spark.sql.execution.arrow.maxRecordsPerBatch"
METADATA_PREFIX = "mmpack_meta_"  # a commit's own facts (commit's ``metadata``) in its commit info
WRITTEN_FILE = pa.schema(
    [
        ("path", pa.string()),
        ("size", pa.int64()),
        ("rows", pa.int64()),
        ("modification_time", pa.int64()),
    ]
)


class TableError(MmpackError, RuntimeError):
    """A Delta table that cannot be read or written correctly."""


@dataclass(frozen=True)
class CommitResult:
    table: str
    version: int
    rows: int
    files: int
    skipped: bool  # True: this run id was already committed; nothing was written


def app_id(run_id: str) -> str:
    return f"mmpack:{run_id}"


def open_table(uri: str, storage: fs.Storage = fs.LOCAL, version: int | None = None) -> DeltaTable | None:
    """The Delta table at ``uri`` (at ``version``, default the latest), or None if there is none yet."""
    options = storage.delta_options(uri)
    if not DeltaTable.is_deltatable(uri, storage_options=options):
        return None
    return DeltaTable(uri, version=version, storage_options=options)


def committed_run(
    uri: str, run_id: str, mode: str = "append", storage: fs.Storage = fs.LOCAL
) -> CommitResult | None:
    """The commit this run id made, if it still stands: anywhere in the log for ``append``,
    the latest commit for ``overwrite`` (another run may have overwritten it since)."""
    table = open_table(uri, storage)
    if table is None or table.transaction_version(app_id(run_id)) is None:
        return None
    for entry in table.history():
        if entry.get("mmpack_run_id") == run_id:
            if mode == "overwrite" and int(entry["version"]) != table.version():
                return None
            return CommitResult(
                uri,
                int(entry["version"]),
                int(entry["mmpack_rows"]),
                int(entry["mmpack_files"]),
                skipped=True,
            )
    raise TableError(f"{uri}: run {run_id} is in the transaction log but its commit is gone")


def commit_metadata(uri: str, run_id: str, storage: fs.Storage = fs.LOCAL) -> dict[str, str]:
    """The ``metadata`` that run ``run_id``'s commit of the table at ``uri`` carries (``commit``)."""
    table = open_table(uri, storage)
    for entry in table.history() if table is not None else []:
        if entry.get("mmpack_run_id") == run_id:
            return {
                k.removeprefix(METADATA_PREFIX): v for k, v in entry.items() if k.startswith(METADATA_PREFIX)
            }
    raise TableError(f"{uri}: no commit of run {run_id}")


def check_readable(table: DeltaTable, uri: str) -> None:
    """Refuse tables whose files a plain Parquet read would get wrong: files with deletion
    vectors (deleted rows would come back) and column mapping (physical names differ)."""
    mode = table.metadata().configuration.get("delta.columnMapping.mode") or "none"
    if mode != "none":
        raise TableError(f"{uri}: uses column mapping mode '{mode}', which mmpack cannot read")
    features = set(table.protocol().reader_features or [])
    if "deletionVectors" in features and pa.table(table.deletion_vectors()).num_rows:
        raise TableError(
            f"{uri}: has files with deletion vectors, which mmpack cannot read; "
            "rewrite the table without them (e.g. OPTIMIZE ... / REORG TABLE ... APPLY (PURGE))"
        )


@dataclass(frozen=True)
class Snapshot:
    """One read of a table's log: its version, current data files and Arrow schema."""

    version: int
    files: list[str]
    schema: pa.Schema


def snapshot(uri: str, storage: fs.Storage = fs.LOCAL, version: int | None = None) -> Snapshot:
    """The table's current state (or that of ``version``), after the safety checks (one pass
    over the Delta log)."""
    table = open_table(uri, storage, version)
    if table is None:
        raise TableError(f"no Delta table at {uri}")
    check_readable(table, uri)
    files = sorted(urllib.parse.unquote(u) for u in table.file_uris())  # delta-rs percent-encodes them
    return Snapshot(table.version(), files, pa.schema(table.schema().to_arrow()))


def data_files(uri: str, storage: fs.Storage = fs.LOCAL) -> tuple[int, list[str]]:
    """The table version and the URIs of its current data files, after the safety checks."""
    snap = snapshot(uri, storage)
    return snap.version, snap.files


def read_arrow(
    uri: str,
    storage: fs.Storage = fs.LOCAL,
    columns: Sequence[str] | None = None,
    snap: Snapshot | None = None,
) -> pa.Table:
    """The table (or some of its columns) as Arrow on the driver: small tables, reports, tests.
    ``snap``: read that snapshot (one already taken) instead of the table's current state."""
    snap = snap or snapshot(uri, storage)
    schema = snap.schema if columns is None else pa.schema([snap.schema.field(c) for c in columns])
    if not snap.files:
        return schema.empty_table()
    parts = []
    for file in snap.files:
        filesystem, path = storage.filesystem(file)
        parts.append(pq.read_table(path, columns=columns, filesystem=filesystem))
    return pa.concat_tables(parts, promote_options="permissive")


def read_table(spark, uri: str, storage: fs.Storage = fs.LOCAL, snap: Snapshot | None = None):
    """A Spark DataFrame over the table's current files (local: Spark's Parquet reader), or
    over those of ``snap``."""
    snap = snap or snapshot(uri, storage)
    return read_parquet(spark, snap.files, snap.schema, storage)


def read_parquet(spark, files: Sequence[str], arrow_schema: pa.Schema, storage: fs.Storage = fs.LOCAL):
    """A Spark DataFrame over Parquet ``files`` of ``arrow_schema`` (local: Spark's Parquet
    reader; S3: one task per file reading it with pyarrow)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    spark_schema = from_arrow_schema(arrow_schema)
    if not files:
        return spark.createDataFrame([], spark_schema)
    if not any(fs.is_s3(f) for f in files):
        return spark.read.schema(spark_schema).parquet(*files)
    listing = one_task_per_row(spark, pa.table({"uri": pa.array(list(files), pa.string())}))

    def read_files(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for file in batch.column("uri").to_pylist():
                filesystem, path = storage.filesystem(file)
                yield from (pq.read_table(path, filesystem=filesystem).cast(arrow_schema).to_batches())

    return listing.mapInArrow(releasing(read_files), spark_schema)


def write_table(
    df,
    uri: str,
    schema: pa.Schema,
    *,
    run_id: str,
    mode: str,
    sort_by: Sequence[str],
    rows_per_file: int,
    storage: fs.Storage = fs.LOCAL,
    rows: int | None = None,
) -> CommitResult:
    """Write ``df`` as Parquet files under ``uri`` and commit them as one Delta transaction.

    The same rows always land in the same files with the same bytes: rows are hashed to
    ``ceil(rows / rows_per_file)`` partitions by ``sort_by`` and sorted inside each, in row
    groups of Spark's Arrow batch size (``spark.sql.execution.arrow.maxRecordsPerBatch``).
    ``rows``: the rows of ``df`` where the caller has counted them already (a Spark job less);
    the files written must hold exactly that many.
    """
    previous = committed_run(uri, run_id, mode, storage)
    if previous is not None:
        return previous
    if rows is None:
        rows = df.count()
    n_files = max(1, math.ceil(rows / rows_per_file)) if rows else 0
    written: list[dict] = []
    if n_files:
        tag = run_tag(run_id)
        ordered = df.select(*schema.names).repartition(n_files, *sort_by).sortWithinPartitions(*sort_by)
        from pyspark.sql.pandas.types import from_arrow_schema

        files = ordered.mapInArrow(
            releasing(_partition_writer(uri, schema, tag, storage)), from_arrow_schema(WRITTEN_FILE)
        )
        written = [r.asDict() for r in files.collect()]
    total = sum(w["rows"] for w in written)
    if total != rows:
        raise TableError(f"{uri}: wrote {total} rows but the DataFrame has {rows}")
    version = commit(uri, schema, written, run_id=run_id, mode=mode, rows=rows, storage=storage)
    return CommitResult(uri, version, rows, len(written), skipped=False)


def write_part(
    uri: str,
    name: str,
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    storage: fs.Storage = fs.LOCAL,
) -> dict | None:
    """Stream ``batches`` into the Parquet file ``uri/name``; its add-action facts, or None
    when there were no rows (no file is left behind)."""
    filesystem, root = storage.filesystem(uri)
    if not fs.is_s3(uri):
        filesystem.create_dir(root, recursive=True)
    path = f"{root}/{name}"
    rows, sink, writer = 0, None, None
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if writer is None:
                sink = filesystem.open_output_stream(path)
                writer = pq.ParquetWriter(sink, schema, compression="zstd")
            writer.write_batch(batch.cast(schema))
            rows += batch.num_rows
    finally:
        if writer is not None:
            writer.close()
            sink.close()
    if writer is None:
        return None
    info = filesystem.get_file_info(path)
    mtime = info.mtime_ns // 1_000_000 if info.mtime_ns else 0
    return {"path": name, "size": info.size, "rows": rows, "modification_time": mtime}


def run_tag(run_id: str) -> str:
    """The part of data file names that ties them to a run."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:16]


def _partition_writer(uri: str, schema: pa.Schema, tag: str, storage: fs.Storage):
    """The mapInArrow function that writes one partition to one Parquet file."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        name = f"part-{TaskContext.get().partitionId():05d}-{tag}.parquet"
        written = write_part(uri, name, batches, schema, storage)
        if written is not None:
            yield pa.RecordBatch.from_pylist([written], schema=WRITTEN_FILE)

    return write


def first_rows(batches: Iterable[pa.RecordBatch], key: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """The batches (sorted by ``key``) without the rows whose key equals the row before."""
    previous: list | None = None
    for batch in batches:
        if batch.num_rows == 0:
            continue
        columns = [batch.column(name) for name in key]
        same = np.ones(batch.num_rows - 1, dtype=bool)
        for column in columns:
            same &= (
                pc.equal(column.slice(1), column.slice(0, len(column) - 1))
                .fill_null(False)
                .to_numpy(zero_copy_only=False)
            )
        keep = np.concatenate([[True], ~same])
        first = [column[0].as_py() for column in columns]
        keep[0] = first != previous
        previous = [column[-1].as_py() for column in columns]
        yield batch.filter(pa.array(keep))


def regroup(batches: Iterable[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """The same rows in batches of exactly ``rows`` (the last one shorter); ``rows`` < 1: one."""
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        held.append(batch)
        count += batch.num_rows
        while rows > 0 and count >= rows:
            table = pa.Table.from_batches(held)
            yield from table.slice(0, rows).combine_chunks().to_batches()
            held = table.slice(rows).to_batches()
            count -= rows
    if count:
        yield from pa.Table.from_batches(held).combine_chunks().to_batches()


def commit(
    uri: str,
    schema: pa.Schema,
    written: list[dict],
    *,
    run_id: str,
    mode: str,
    rows: int,
    storage: fs.Storage,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Commit ``written`` as one transaction carrying ``run_id`` (and ``metadata``, which
    ``commit_metadata`` reads back); the table's version after it. A run whose commit still
    stands is not committed again (a re-run after a kill between two tables' commits, a retried
    driver): its version is returned."""
    done = committed_run(uri, run_id, mode, storage)
    if done is not None:
        return done.version
    actions = [
        AddAction(
            path=w["path"],
            size=w["size"],
            partition_values={},
            modification_time=w["modification_time"],
            data_change=True,
            stats=json.dumps({"numRecords": w["rows"]}),
        )
        for w in sorted(written, key=lambda w: w["path"])
    ]
    properties = CommitProperties(
        custom_metadata={
            "mmpack_run_id": run_id,
            "mmpack_rows": str(rows),
            "mmpack_files": str(len(actions)),
            **{METADATA_PREFIX + k: v for k, v in (metadata or {}).items()},
        },
    )
    options = storage.delta_options(uri)
    table = open_table(uri, storage)
    txn_version = 1 if table is None else table.version() + 1
    properties.app_transactions = [Transaction(app_id(run_id), txn_version)]
    if table is None:
        create_table_with_add_actions(
            uri,
            Schema.from_arrow(schema),
            actions,
            mode="error",
            storage_options=options,
            commit_properties=properties,
        )
    else:
        table.create_write_transaction(actions, mode=mode, schema=schema, commit_properties=properties)
    return open_table(uri, storage).version()
