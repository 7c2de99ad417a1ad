"""Input files → splits (driver) → raw records with their position (executors).

A split is a unit of reading that one task handles: a byte range of a JSONL file, a
whole JSON file, one row group of a Parquet file, or a whole WebDataset tar (streamed).
Each raw record keeps its source file and position so that any quarantine row points back
at the exact input:

- JSONL: the byte offset where the line starts (blank lines are not records);
- JSON:  the index of the element in the top-level array (a lone object is index 0);
- Parquet: the row index in the file;
- WebDataset tar: the byte offset of the key's first member header (``webdataset``).

Every split also reports how many records it read, independently of what happens to
them later; the normalize job reconciles against that count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs
from mmpack_udfs.normalize import json_array, webdataset
from mmpack_udfs.normalize.sharegpt import BLOB_KEY, NON_TEXT_KEY, DatasetSpec
from mmpack_udfs.reasons import Reason

FORMATS_BY_EXTENSION = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".tar": "webdataset",
}
READ_CHUNK = 1 << 20
JSONL_BLOCK = 8 << 20  # bytes of a JSONL split cut into lines at a time
NEWLINE = ord("\n")
ASCII_WHITESPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() removes
LINES = pa.schema([("source_position", pa.int64()), ("raw", pa.string()), ("error", pa.string())])
MIN_SPLIT_BYTES = 1 << 20  # JSONL byte ranges are cut no smaller than this (jsonl_split_bytes)
BATCH_BYTES = 32 << 20  # raw records handed on at a time, at most (about: one record may be larger)
UTF8_BOM = b"\xef\xbb\xbf"

SPLIT = pa.schema(
    [
        ("dataset", pa.string()),
        ("uri", pa.string()),
        ("format", pa.string()),
        ("start", pa.int64()),
        ("length", pa.int64()),
    ]
)
RAW = pa.schema(
    [
        ("dataset", pa.string()),
        ("source_file", pa.string()),
        ("source_position", pa.int64()),
        ("raw", pa.string()),
        ("error", pa.string()),  # set when the record could not even be decoded
        ("records_read", pa.int64()),  # set on the one summary row per split
        ("blobs", pa.list_(pa.binary())),  # inline media bytes of the record (Parquet), in marker order
    ]
)


class RawRecord(NamedTuple):
    """One record as read: its position, its JSON text (or an error) and its inline bytes."""

    position: int
    raw: str | None
    error: str | None = None
    blobs: list[bytes] | None = None


class InputError(MmpackError, ValueError):
    """Input files that cannot be planned (none found, unknown format)."""


@dataclass(frozen=True)
class Split:
    dataset: str
    uri: str
    format: str
    start: int
    length: int


@dataclass(frozen=True)
class InputFile:
    dataset: str
    uri: str
    format: str
    size: int
    mtime_ns: int


def list_inputs(specs: Sequence[DatasetSpec], storage: fs.Storage = fs.LOCAL) -> list[InputFile]:
    """Every input file of every dataset, with its format; errors for empty or unknown inputs."""
    files: list[InputFile] = []
    for spec in specs:
        if spec.media_root and not fs.is_s3(spec.media_root) and not os.path.isdir(spec.media_root):
            raise InputError(
                f"dataset '{spec.name}': media_root {spec.media_root} is not a directory (every "
                "media reference would be quarantined); fix the path (relative to the config file)"
            )
        uris = sorted({u for pattern in spec.paths for u in storage.expand(pattern)})
        if not uris:
            raise InputError(f"dataset '{spec.name}': no input files match {list(spec.paths)}")
        for uri in uris:
            info = storage.file_info(uri)
            fmt = detect_format(uri, spec.format, storage)
            files.append(InputFile(spec.name, uri, fmt, info.size, info.mtime_ns or 0))
    return files


def detect_format(uri: str, configured: str, storage: fs.Storage = fs.LOCAL) -> str:
    """The configured format, or one from the extension (a .json of JSON lines is jsonl)."""
    if configured != "auto":
        return configured
    ext = os.path.splitext(uri)[1].lower()
    if ext not in FORMATS_BY_EXTENSION:
        raise InputError(
            f"{uri}: cannot tell the format from '{ext}' (use .json, .jsonl, .parquet or .tar, "
            "set the dataset's format, or narrow its paths)"
        )
    fmt = FORMATS_BY_EXTENSION[ext]
    if fmt == "json" and _looks_like_json_lines(uri, storage):
        return "jsonl"
    return fmt


def _looks_like_json_lines(uri: str, storage: fs.Storage) -> bool:
    head = storage.read_bytes(uri, 0, READ_CHUNK).removeprefix(UTF8_BOM).lstrip()
    if not head.startswith(b"{"):
        return False
    lines = head.rstrip().split(b"\n")
    if sum(line.startswith(b"{") for line in lines) >= 2:  # objects at the start of lines: JSON lines,
        return True  # even when the first one is broken (pretty-printed JSON indents its inner lines)
    try:
        return isinstance(json.loads(lines[0]), dict) and len(lines) > 1
    except ValueError:
        return False


def jsonl_split_bytes(files: Sequence[InputFile], split_bytes: int, tasks: int) -> int:
    """The byte ranges' size JSONL files are cut into: ``split_bytes`` at most, smaller where
    that gives ``tasks`` splits or more (down to ``MIN_SPLIT_BYTES``), so that every core gets
    several and the read can stay in the task that normalizes (``stage._normalized_rows``)."""
    total = sum(f.size for f in files if f.format == "jsonl")
    return min(split_bytes, max(MIN_SPLIT_BYTES, -(-total // max(tasks, 1))))


def plan_splits(files: Sequence[InputFile], split_bytes: int, storage: fs.Storage = fs.LOCAL) -> list[Split]:
    """Cut files into splits: byte ranges for JSONL, row groups for Parquet."""
    splits: list[Split] = []
    for f in files:
        if f.format == "jsonl":
            starts = range(0, max(f.size, 1), split_bytes)
            splits += [Split(f.dataset, f.uri, f.format, s, split_bytes) for s in starts]
        elif f.format == "parquet":
            groups = pq.ParquetFile(_open(f.uri, storage)).num_row_groups if f.size else 0
            splits += [Split(f.dataset, f.uri, f.format, g, 1) for g in range(max(groups, 1))]
        else:
            splits.append(Split(f.dataset, f.uri, f.format, 0, f.size))
    return splits


def splits_table(splits: Sequence[Split]) -> pa.Table:
    return pa.Table.from_pylist([asdict(s) for s in splits], schema=SPLIT)


def _open(uri: str, storage: fs.Storage = fs.LOCAL):
    filesystem, path = storage.filesystem(uri)
    return filesystem.open_input_file(path)


def read_split(
    split: Split, storage: fs.Storage = fs.LOCAL, specs: Mapping[str, DatasetSpec] | None = None
) -> Iterator[dict]:
    """Raw records of one split, then one summary row with ``records_read``. ``specs``: the
    datasets by name, which WebDataset tars need (the keys their records keep media under)."""
    spec = (specs or {}).get(split.dataset)
    records = READERS[split.format](split, storage, spec)
    count = 0
    for record in records:
        count += 1
        yield _raw(split, record)
    yield {**_raw(split, RawRecord(-1, None)), "records_read": count}


def _raw(split: Split, record: RawRecord) -> dict:
    return {
        "dataset": split.dataset,
        "source_file": split.uri,
        "source_position": record.position,
        "raw": record.raw,
        "error": record.error,
        "records_read": None,
        "blobs": record.blobs,
    }


def _read_jsonl(split: Split, storage: fs.Storage, spec: DatasetSpec | None = None) -> Iterator[RawRecord]:
    """Lines whose first byte lies in [start, start + length), one by one (``jsonl_batches``)."""
    for batch in jsonl_batches(split, storage):
        columns = (batch.column(name).to_pylist() for name in LINES.names)
        yield from (RawRecord(*row) for row in zip(*columns, strict=True))


def jsonl_batches(split: Split, storage: fs.Storage = fs.LOCAL) -> Iterator[pa.RecordBatch]:
    """The records of a JSONL split as RAW batches, ``JSONL_BLOCK`` bytes of the file at a time:
    the lines whose first byte lies in [start, start + length), blank lines left out, a
    trailing ``\r`` and the file's UTF-8 BOM removed. The lines are cut and decoded with Arrow
    and NumPy, no Python per line, except in a block holding a line that is not UTF-8."""
    with _open(split.uri, storage) as f:
        end = min(split.start + split.length, f.size())
        pos = split.start
        if pos > 0:  # the line that straddles our start belongs to the previous split
            f.seek(pos - 1)
            pos = pos - 1 + _skip_line(f)
        f.seek(pos)
        carry = b""
        while pos < end:
            chunk = f.read(JSONL_BLOCK)
            data = carry + chunk
            if not data:
                return
            cut = data.rfind(b"\n") + 1 if chunk else len(data)  # whole lines; at the end, the rest
            if cut == 0:  # no line ends in this block yet: read on
                carry = data
                continue
            lines = _block_lines(data[:cut], pos, end)
            if lines.num_rows:
                yield _raw_batch(split, lines)
            carry, pos = data[cut:], pos + cut


def _block_lines(block: bytes, base: int, end: int) -> pa.RecordBatch:
    """(source_position, raw, error) of the records among the whole lines of ``block``, which
    starts at byte ``base`` of its file; only lines that start before ``end``. Arrow holds the
    lines in the block's own bytes (each with its newline), checks them as UTF-8, leaves out the
    blank ones (``bytes.strip()``) and trims the trailing ``\r`` and newline in C++."""
    data = np.frombuffer(block, np.uint8)
    newlines = np.flatnonzero(data == NEWLINE)
    starts = np.concatenate(([0], newlines + 1))[: len(newlines) + (data[-1] != NEWLINE)]
    offsets = np.concatenate((starts, [len(data)])).astype(np.int32)
    lines = pa.StringArray.from_buffers(len(starts), pa.py_buffer(offsets), pa.py_buffer(block))
    try:
        lines.validate(full=True)
    except pa.ArrowInvalid:  # a line that is not UTF-8: decode each line of the block as bytes
        stops = offsets[1:] - (data[offsets[1:] - 1] == NEWLINE)  # without its newline
        return _block_lines_one_by_one(block, base, end, starts, stops)
    nonblank = pc.greater(pc.binary_length(pc.ascii_trim(lines, ASCII_WHITESPACE)), 0)
    keep = pc.and_(pa.array(base + starts < end), nonblank)
    if base == 0 and block.startswith(UTF8_BOM):  # the same lines, the file's first without its BOM
        offsets[0] = len(UTF8_BOM)
        lines = pa.StringArray.from_buffers(len(starts), pa.py_buffer(offsets), pa.py_buffer(block))
    texts = pc.utf8_rtrim(lines.filter(keep), "\r\n")  # no newline inside a line: str.rstrip("\r")
    positions = pa.array(base + starts).filter(keep)
    return pa.record_batch([positions, texts, pa.nulls(len(texts), pa.string())], schema=LINES)


def _block_lines_one_by_one(block: bytes, base: int, end: int, starts, stops) -> pa.RecordBatch:
    """``_block_lines`` for a block with a line that is not UTF-8, in Python line by line."""
    decoded = [
        _decode_line(base + int(a), block[a:b])
        for a, b in zip(starts, stops, strict=True)
        if base + a < end and block[a:b].strip()
    ]
    rows = [{"source_position": d.position, "raw": d.raw, "error": d.error} for d in decoded]
    return pa.RecordBatch.from_pylist(rows, schema=LINES)


def _raw_batch(split: Split, lines: pa.RecordBatch) -> pa.RecordBatch:
    """RAW rows of ``lines`` (``_block_lines``) read from ``split``."""
    n = lines.num_rows
    columns = {
        "dataset": pa.array([split.dataset] * n, pa.string()),
        "source_file": pa.array([split.uri] * n, pa.string()),
        **{name: lines.column(name) for name in LINES.names},
        "records_read": pa.nulls(n, pa.int64()),
        "blobs": pa.nulls(n, RAW.field("blobs").type),
    }
    return pa.record_batch([columns[name] for name in RAW.names], schema=RAW)


def _skip_line(f) -> int:
    """Bytes up to and including the next newline (or to the end)."""
    skipped = 0
    while True:
        chunk = f.read(READ_CHUNK)
        if not chunk:
            return skipped
        newline = chunk.find(b"\n")
        if newline >= 0:
            return skipped + newline + 1
        skipped += len(chunk)


def _decode_line(position: int, line: bytes) -> RawRecord:
    if position == 0:
        line = line.removeprefix(UTF8_BOM)  # editors on Windows start files with one
    try:
        return RawRecord(position, line.decode("utf-8").rstrip("\r"))
    except UnicodeDecodeError as err:
        return RawRecord(position, line.decode("utf-8", errors="replace"), f"invalid_json: not UTF-8: {err}")


def _read_json(split: Split, storage: fs.Storage, spec: DatasetSpec | None = None) -> Iterator[RawRecord]:
    """Elements of a top-level JSON array, streamed (a task holds one element, however large
    the file); a file that is not valid JSON as a whole is one invalid_json record, so the
    whole file is checked before its first element is given."""
    try:
        with _open(split.uri, storage) as f:
            for _ in json_array.elements(f):
                pass
    except (ValueError, UnicodeDecodeError) as err:
        yield RawRecord(0, _whole_text(split, storage), f"invalid_json: {err}")
        return
    except RecursionError:
        yield RawRecord(0, _whole_text(split, storage), "invalid_json: nested too deeply to parse")
        return
    with _open(split.uri, storage) as f:
        for index, item in enumerate(json_array.elements(f)):
            yield RawRecord(index, json.dumps(item, ensure_ascii=False))


def _whole_text(split: Split, storage) -> str:
    return storage.read_bytes(split.uri).decode("utf-8", errors="replace")


def _read_parquet(split: Split, storage: fs.Storage, spec: DatasetSpec | None = None) -> Iterator[RawRecord]:
    """Rows of one row group, as JSON text with their bytes set aside (``_set_aside``)."""
    with _open(split.uri, storage) as f:
        parquet = pq.ParquetFile(f)
        if parquet.num_row_groups == 0:
            return
        offset = sum(parquet.metadata.row_group(g).num_rows for g in range(split.start))
        rows = parquet.read_row_group(split.start).to_pylist()
    for index, row in enumerate(rows):
        blobs: list[bytes] = []
        text = json.dumps(_set_aside(row, blobs), ensure_ascii=False, default=_non_text)
        yield RawRecord(offset + index, text, None, blobs or None)


def _read_webdataset(split: Split, storage: fs.Storage, spec: DatasetSpec | None) -> Iterator[RawRecord]:
    """One record per key of the tar, read as a stream (``webdataset``)."""
    if spec is None:
        raise ValueError(f"{split.uri}: a WebDataset tar is read with its dataset's spec ({split.dataset!r})")
    filesystem, path = storage.filesystem(split.uri)
    with filesystem.open_input_stream(path) as stream:
        for key in webdataset.keys(stream):
            if isinstance(key, webdataset.Damage):
                yield RawRecord(key.offset, None, f"{Reason.TAR_UNREADABLE}: {key.detail}")
                continue
            text, error, blobs = webdataset.record_of(key, spec)
            yield RawRecord(key.offset, text, error, blobs or None)


# A split's reader by format: (split, storage, its dataset's spec) -> raw records. Only tars use
# the spec (the keys their records keep media under).
READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet, "webdataset": _read_webdataset}


def _non_text(value: Any) -> dict[str, str]:
    """A Parquet value JSON has no type for (timestamp, date, time, duration, decimal) as a
    marked object, never as text: a turn holding one is quarantined (non_string_content)."""
    return {NON_TEXT_KEY: type(value).__name__, "value": str(value)}


def _set_aside(value: Any, blobs: list[bytes]) -> Any:
    """``value`` with its bytes made JSON: every ``bytes`` value (image or audio bytes, a Hugging
    Face ``Image`` struct's ``bytes``, and bytes that happen to be UTF-8 too) goes to ``blobs`` and
    leaves ``{BLOB_KEY: index}`` in its place. Bytes are never read as text: a turn holding them
    is quarantined (non_string_content), as a timestamp is."""
    if isinstance(value, dict):
        return {k: _set_aside(v, blobs) for k, v in value.items()}
    if isinstance(value, list):
        return [_set_aside(v, blobs) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        blobs.append(bytes(value))
        return {BLOB_KEY: len(blobs) - 1}
    return value


def read_splits_batches(
    batches: Iterator[pa.RecordBatch],
    storage: fs.Storage = fs.LOCAL,
    specs: Mapping[str, DatasetSpec] | None = None,
    batch_rows: int = 1000,
    batch_bytes: int = BATCH_BYTES,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: split rows in, raw record rows out, in batches of at most
    ``batch_rows`` rows or about ``batch_bytes`` of text and inline media (tars and Parquet
    files of large images: a task's memory stays flat however large its input)."""
    rows: list[dict] = []
    held = 0
    for batch in batches:
        for split in (Split(**row) for row in batch.to_pylist()):
            if split.format == "jsonl":  # as Arrow batches, no Python per record
                if rows:
                    yield pa.RecordBatch.from_pylist(rows, schema=RAW)
                    rows, held = [], 0
                count = 0
                for lines in jsonl_batches(split, storage):
                    count += lines.num_rows
                    yield lines
                rows.append({**_raw(split, RawRecord(-1, None)), "records_read": count})
                continue
            for row in read_split(split, storage, specs):
                rows.append(row)
                held += len(row["raw"] or "") + sum(map(len, row["blobs"] or ()))
                if len(rows) >= batch_rows or held >= batch_bytes:
                    yield pa.RecordBatch.from_pylist(rows, schema=RAW)
                    rows, held = [], 0
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=RAW)
