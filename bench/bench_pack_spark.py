"""Pack-stage throughput on local Spark: a synthetic tokenized Delta table → shards + manifest.

    .venv/bin/python bench/bench_pack_spark.py --rows 1000000 [--master local[2]]

1. Writes (not timed, reused across runs) a tokenized Delta table of --rows text-only
   rows: lengths lognormal(mean log 5.0, sigma 0.8) clipped to [8, 16384] (mean ≈ 200
   tokens), random ids, the first half of every sample unsupervised, sample ids of 32 hex
   digits as normalize makes them; 10 files.
2. Times `pack.run` with the default config (budget 16,384): the driver's count pass and
   first-fit-decreasing over all rows, the cost-stratified layout, the join of every row
   to its place and the shuffle by shard, shard assembly and writing (zstd), manifest,
   cost index, report.
3. Compares the fill with a plain FFD over the same lengths (the same packing now).
Results: bench/out/pack_spark-ROWS.json (with the peak resident memory of the driver's
Python and JVM, and of the Python workers); copy the line into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time

import numpy as np
import pyarrow as pa
from common import OUT, PeakMemory, bench_spark, machine, parse_with_smoke

from mmpack_udfs import schemas
from mmpack_udfs.config import load_config
from mmpack_udfs.context import RunContext
from mmpack_udfs.io import fs, tables
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.pack.ffd import first_fit_decreasing

FILES = 10


def synthetic_table(out, rows: int, seed: int = 0) -> np.ndarray:
    """Write the tokenized table under ``out`` (once); return its lengths."""
    uri = schemas.table_uri(str(out), "tokenized")
    marker = out / f".complete-{rows}-sha-ids"
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 0.8, rows), 8, 16384).astype(np.int64)
    if marker.exists():
        return lengths
    shutil.rmtree(out, ignore_errors=True)
    written = []
    for part, index in enumerate(np.array_split(np.arange(rows), FILES)):
        written.append(
            tables.write_part(
                uri, f"part-{part:05d}.parquet", [_batch(index, lengths, rng)], schemas.TOKENIZED, fs.LOCAL
            )
        )
    tables.commit(
        uri, schemas.TOKENIZED, written, run_id="bench", mode="overwrite", rows=rows, storage=fs.LOCAL
    )
    marker.touch()
    return lengths


def sample_ids(index: np.ndarray) -> pa.Array:
    """Ids as normalize makes them (32 hex digits of a SHA-256): the driver holds them per row."""
    return pa.array([hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in index])


def _batch(index: np.ndarray, lengths: np.ndarray, rng) -> pa.RecordBatch:
    part = lengths[index]
    offsets = pa.array(np.concatenate([[0], np.cumsum(part)]).astype(np.int32))
    ids = rng.integers(0, 150_000, int(part.sum())).astype(np.int32)
    position = np.arange(len(ids)) - np.repeat(offsets.to_numpy()[:-1], part)
    labels = np.where(position < np.repeat(part // 2, part), -100, ids).astype(np.int32)
    n = len(index)
    zeros = pa.array(np.zeros(n, np.int32))
    columns = {
        "sample_id": (names := sample_ids(index)),
        "parent_id": names,
        "dataset": pa.array(["bench"] * n),
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
        "labels": pa.ListArray.from_arrays(offsets, pa.array(labels)),
        "num_tokens": pa.array(part.astype(np.int32)),
        "text_tokens": pa.array(part.astype(np.int32)),
        "image_tokens": zeros,
        "video_tokens": zeros,
        "supervised_tokens": pa.array((part - part // 2).astype(np.int32)),
        "media": pa.array([[]] * n, pa.list_(schemas.TOKENIZED_MEDIA)),
        "pair_side": pa.nulls(n, pa.string()),
        "weight": pa.array(np.ones(n)),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=schemas.TOKENIZED)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="6g", help="spark.driver.memory (the JVM's heap)")
    args = parse_with_smoke(parser, rows=5000)

    out = OUT / "pack-spark"
    started = time.perf_counter()
    lengths = synthetic_table(out, args.rows)
    took = time.perf_counter() - started
    print(f"tokenized table: {args.rows:,} rows, {lengths.sum():,} tokens ({took:.1f} s)")
    memory = PeakMemory()
    memory.start()
    spark = bench_spark(args.master, driver_memory=args.driver_memory)
    config = load_config(None, [f"output={out}", "run_id=bench-pack"])
    shutil.rmtree(out / "packed", ignore_errors=True)
    started = time.perf_counter()
    summary = pack.run(spark, RunContext.of(config))
    seconds = time.perf_counter() - started
    memory.stop.set()
    memory.join()
    budget = summary["budget"]
    global_bins = first_fit_decreasing(lengths, budget).num_bins
    result = {
        "machine": machine(),
        "master": args.master,
        "rows": args.rows,
        "tokens": int(lengths.sum()),
        "seconds": round(seconds, 1),
        "rows_per_s": round(args.rows / seconds),
        "tokens_per_s": round(int(lengths.sum()) / seconds),
        "shards": json.loads((out / "packed" / "manifest.json").read_text())["totals"]["shards"],
        "bins": summary["bins"],
        "fill": summary["fill"],
        "global_ffd_bins": global_bins,
        "global_ffd_fill": round(int(lengths.sum()) / (global_bins * budget), 6),
        "shard_bytes": summary["bytes"],
        "driver_memory": args.driver_memory,
        "peak_memory_gib": memory.gib(),
        "peak_driver_python_bytes_per_row": round(memory.peak["driver"] / args.rows, 1),
        "peak_jvm_bytes_per_row": round(memory.peak["jvm"] / args.rows, 1),
    }
    print(json.dumps(result, indent=2))
    (OUT / f"pack_spark-{args.rows}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
