"""Valid samples → the ``samples`` table's files, without passing the rows through Spark's JVM.

    normalize tasks: their samples sorted by ``SORT_KEY``, written as *runs* (Parquet files
        of ``RUN_GROUP_ROWS``-row groups, ``RUN_ROWS`` rows at most) in a scratch folder
    one Spark task per file: an equal range of the sample-id space (``id_ranges``: ids are
        hashes); it reads the row groups of every run that overlap its range, sorts them,
        keeps each id's first row by ``FIRST_BY`` and writes the file in row groups of
        Spark's Arrow batch size

As a Spark shuffle, the rows cross the disk once; unlike one, they never become JVM rows,
which cost more than the Python that made them (nested turns and media, converted value by
value: bench/RESULTS.md, issue 58). The files hold what a shuffle by ``sample_id`` sorted
within each partition would hold, with ranges for hash partitions: the same bytes when the
table is one file.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs.io import fs, tables
from mmpack_udfs.io.ahead import read_ahead
from mmpack_udfs.io.memory import release_memory
from mmpack_udfs.schemas import SAMPLES

FIRST_BY = ("dataset", "source_file", "source_position")  # which of a sample_id's rows is kept
SORT_KEY = ("sample_id", *FIRST_BY)
SORT_ORDER = [(k, "ascending") for k in SORT_KEY]
RUN_ROWS = 10_000  # samples a task holds before it writes them as a run
RUN_GROUP_ROWS = 1_000  # rows per row group of a run: how finely a range reads it
MERGE_ROWS = 10_000  # about the rows a file's task holds at a time (it merges its range in parts)
ID_PREFIX_DIGITS = 16  # hex digits of an id that place it in a range
MERGED = pa.schema(  # a range's file (tables.WRITTEN_FILE) and the samples it kept per dataset
    [*tables.WRITTEN_FILE, ("kept", pa.list_(pa.struct([("dataset", pa.string()), ("rows", pa.int64())])))]
)
KEPT_KEY = "kept"  # the commit's samples kept per dataset (JSON), for a re-run that finds it done
RANGE = pa.schema([("index", pa.int32()), ("low", pa.string()), ("high", pa.string()), ("parts", pa.int32())])


class RunWriter:
    """A task's samples, written as sorted runs under ``folder`` (``run-<task>-<k>.parquet``);
    ``close`` writes the rest and returns (run uri, samples per dataset) of each run."""

    def __init__(self, folder: str, task: int, storage: fs.Storage, run_rows: int = RUN_ROWS) -> None:
        self.folder, self.task, self.storage, self.run_rows = folder, task, storage, run_rows
        self.held: list[pa.RecordBatch] = []
        self.rows = 0
        self.runs: list[tuple[str, dict[str, int]]] = []

    def add(self, batch: pa.RecordBatch) -> None:
        """Hold ``batch`` (rows of ``SAMPLES``' columns); write a run once ``run_rows`` are held."""
        if batch.num_rows:
            self.held.append(batch)
            self.rows += batch.num_rows
        if self.rows >= self.run_rows:
            self._write()

    def close(self) -> list[tuple[str, dict[str, int]]]:
        if self.rows:
            self._write()
        return self.runs

    def _write(self) -> None:
        table = pa.Table.from_batches(self.held).cast(SAMPLES)
        self.held, self.rows = [], 0
        table = table.take(pc.sort_indices(table, sort_keys=SORT_ORDER))
        uri = fs.join(self.folder, f"run-{self.task:05d}-{len(self.runs):04d}.parquet")
        filesystem, path = self.storage.filesystem(uri)
        if not fs.is_s3(uri):
            filesystem.create_dir(self.folder, recursive=True)
        with filesystem.open_output_stream(path) as sink:  # scratch: fast to write and read back
            pq.write_table(table, sink, row_group_size=RUN_GROUP_ROWS, compression="lz4")
        per_dataset = pc.value_counts(table.column("dataset")).to_pylist()
        self.runs.append((uri, {c["values"]: c["counts"] for c in per_dataset}))
        del table
        release_memory()


def id_ranges(files: int) -> list[tuple[str, str | None]]:
    """``files`` equal ranges [low, high) of the sample-id space (32 hex digits of a hash), as
    the id prefixes they start at; the last is open. Any string falls in exactly one."""
    if files < 1:
        return []
    span = 16**ID_PREFIX_DIGITS
    starts = [""] + [format(-(-k * span // files), f"0{ID_PREFIX_DIGITS}x") for k in range(1, files)]
    return [(low, starts[k + 1] if k + 1 < files else None) for k, low in enumerate(starts)]


def in_range(ids: pa.Array | pa.ChunkedArray, low: str, high: str | None) -> pa.Array:
    """Which ``ids`` lie in [low, high)."""
    inside = pc.greater_equal(ids, pa.scalar(low))
    if high is not None:
        inside = pc.and_(inside, pc.less(ids, pa.scalar(high)))
    return inside


def sub_ranges(low: str, high: str | None, parts: int) -> list[tuple[str, str | None]]:
    """[low, high) cut into ``parts`` ranges of equal id-prefix width, in order."""
    span = 16**ID_PREFIX_DIGITS
    first = int(low[:ID_PREFIX_DIGITS].ljust(ID_PREFIX_DIGITS, "0") or "0", 16)
    last = span if high is None else int(high, 16)
    cuts = [format(first + k * (last - first) // parts, f"0{ID_PREFIX_DIGITS}x") for k in range(1, parts)]
    bounds = [low, *cuts, high]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b is None or a < b]


class SortedFile:
    """A Parquet file sorted by sample_id (a run, a samples file): its rows in an id range,
    reading only the row groups whose statistics say they may hold some (all where a group has
    none). The footer is read once."""

    def __init__(self, uri: str, storage: fs.Storage) -> None:
        self.filesystem, self.path = storage.filesystem(uri)
        with self.filesystem.open_input_file(self.path) as f:
            self.meta = meta = pq.ParquetFile(f).metadata
        column = next(i for i in range(meta.num_columns) if meta.schema.column(i).path == "sample_id")
        self.bounds = []  # (min, max) sample_id per row group, None where unknown
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            known = stats is not None and stats.has_min_max
            self.bounds.append((stats.min, stats.max) if known else None)

    def rows(self, low: str, high: str | None, columns: Sequence[str] | None = None) -> pa.Table:
        groups = [
            g
            for g, b in enumerate(self.bounds)
            if b is None or (b[1] >= low and (high is None or b[0] < high))
        ]
        with self.filesystem.open_input_file(self.path) as f:
            table = pq.ParquetFile(f, metadata=self.meta).read_row_groups(groups, columns=columns)
        return table.filter(in_range(table.column("sample_id"), low, high))


def merge_range(
    runs: Sequence[str],
    low: str,
    high: str | None,
    existing: Sequence[str],
    storage: fs.Storage,
    parts: int = 1,
) -> Iterator[pa.RecordBatch]:
    """The samples of ``runs`` in [low, high), sorted by ``SORT_KEY``, without the ids of the
    ``existing`` files (an append; duplicates stay: ``tables.first_rows``). Merged ``parts``
    sub-ranges at a time, the next one while the caller writes this one, so a task holds about
    2 / ``parts`` of its range."""
    sources = [SortedFile(uri, storage) for uri in runs]
    known = [SortedFile(uri, storage) for uri in existing]
    for table in read_ahead(
        _merged(sources, known, sub_low, sub_high) for sub_low, sub_high in sub_ranges(low, high, parts)
    ):
        yield from table.to_batches()
        del table
        release_memory()  # the pool keeps a part's pages otherwise: a worker's peak would be them all


def _merged(
    sources: Sequence[SortedFile], known: Sequence[SortedFile], low: str, high: str | None
) -> pa.Table:
    """The rows of ``sources`` in [low, high) without the ids of ``known``, sorted."""
    found = [source.rows(low, high) for source in sources]
    table = (pa.concat_tables(found) if found else SAMPLES.empty_table()).combine_chunks()
    del found
    if known:
        ids = pa.concat_tables([k.rows(low, high, ["sample_id"]) for k in known]).column("sample_id")
        table = table.filter(pc.invert(pc.is_in(table.column("sample_id"), ids.combine_chunks())))
    return table.take(pc.sort_indices(table.select(list(SORT_KEY)), sort_keys=SORT_ORDER))


def write_range(
    runs: Sequence[str],
    item: dict,
    existing: Sequence[str],
    uri: str,
    tag: str,
    group_rows: int,
    storage: fs.Storage,
) -> dict | None:
    """One file of the samples table: the range ``item`` (``RANGE``) merged and written as
    ``part-<index>-<tag>.parquet``; its add-action facts and the samples kept per dataset."""
    kept: Counter[str] = Counter()

    def counted(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for c in pc.value_counts(batch.column("dataset")).to_pylist():
                kept[c["values"]] += c["counts"]
            yield batch

    merged = merge_range(runs, item["low"], item["high"], existing, storage, item["parts"])
    batches = counted(tables.regroup(tables.first_rows(merged, ["sample_id"]), group_rows))
    name = f"part-{item['index']:05d}-{tag}.parquet"
    written = tables.write_part(uri, name, batches, SAMPLES, storage)
    if written is None:
        return None
    return {**written, "kept": [{"dataset": d, "rows": n} for d, n in sorted(kept.items())]}


def write_samples(
    spark,
    runs: Sequence[str],
    rows: int,
    uri: str,
    *,
    rows_per_file: int,
    run_id: str,
    mode: str,
    existing: Sequence[str],
    storage: fs.Storage,
) -> tuple[tables.CommitResult, dict[str, int]]:
    """Spark: the ``rows`` samples of ``runs`` in ``ceil(rows / rows_per_file)`` files of the
    samples table at ``uri``, one task each merging one id range (``existing``: the table's
    files, whose ids an append leaves out); one commit. Returns the commit and the samples kept
    per dataset (duplicates and ids already there are counted in ``rows``, not kept)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from mmpack_udfs.io.memory import releasing
    from mmpack_udfs.io.spark import one_task_per_row

    previous = tables.committed_run(uri, run_id, mode, storage)
    if previous is not None:  # a re-run after a kill before the quarantine's commit
        kept = tables.commit_metadata(uri, run_id, storage).get(KEPT_KEY)
        if kept is None:
            raise tables.TableError(
                f"{uri}: run {run_id} committed its samples without their counts (an older mmpack); "
                "run again with another --run-id"
            )
        return previous, json.loads(kept)
    tag = tables.run_tag(run_id)
    group_rows = int(spark.conf.get(tables.BATCH_ROWS_KEY, "10000"))
    files = math.ceil(rows / rows_per_file)
    parts = math.ceil(rows / max(files, 1) / MERGE_ROWS)
    ranges = [{"index": k, "low": a, "high": b, "parts": parts} for k, (a, b) in enumerate(id_ranges(files))]

    def body(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for item in batch.to_pylist():
                written = write_range(runs, item, existing, uri, tag, group_rows, storage)
                if written is not None:
                    yield pa.RecordBatch.from_pylist([written], schema=MERGED)

    results = []
    if ranges:
        items = one_task_per_row(spark, pa.Table.from_pylist(ranges, schema=RANGE))
        merged = items.mapInArrow(releasing(body), from_arrow_schema(MERGED))
        results = [r.asDict(recursive=True) for r in merged.collect()]
    kept: Counter[str] = Counter()
    for result in results:
        for row in result["kept"]:
            kept[row["dataset"]] += row["rows"]
    written = [{k: r[k] for k in tables.WRITTEN_FILE.names} for r in results]
    rows = sum(w["rows"] for w in written)
    kept_json = json.dumps(dict(sorted(kept.items())))
    version = tables.commit(uri, SAMPLES, written, run_id=run_id, mode=mode, rows=rows, storage=storage,
                            metadata={KEPT_KEY: kept_json})  # fmt: skip
    return tables.CommitResult(uri, version, rows, len(written), skipped=False), dict(kept)
