"""The pack driver's plan at up to 100 M rows: peak memory of the driver's Python, no Spark.

    .venv/bin/python bench/bench_pack_plan.py --rows 100000000

The pack stage plans on the driver (every row's place, one global first-fit-decreasing)
while its shard tasks run on executors; this measures the driver's side alone, at sizes
whose shards would not fit this machine's disk.

1. Writes (not timed, reused across runs) a tokenized Delta table of --rows text rows with
   the count columns the driver reads (lengths lognormal as bench_pack_spark, sample ids of
   32 hex digits as normalize makes them) and empty token lists (the driver never reads
   them); 10 M rows a file.
2. Runs the driver's steps of ``pack.run`` in its order, minus the shard tasks: read the
   counts, the oversize check, the conversations, the mix, the placement, the placement's
   Parquet parts (what the shard tasks read), the mix summary. Peak resident memory of this
   process is sampled every 0.1 s, per step.
3. Fill and bins, against the lower bound.
Results: bench/out/pack_plan-ROWS.json; copy the line into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from common import GIB, OUT, PeakMemory, machine, parse_with_smoke

from mmpack_udfs import schemas
from mmpack_udfs.config import load_config
from mmpack_udfs.io import fs, tables
from mmpack_udfs.io.memory import release_memory
from mmpack_udfs.pack import mix
from mmpack_udfs.pack import stage as pack

ROWS_PER_FILE = 10_000_000
HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def counts_table(out, rows: int, seed: int = 0) -> str:
    """Write the counts-only tokenized table under ``out`` (once); return its uri."""
    uri = schemas.table_uri(str(out), "tokenized")
    marker = out / f".complete-{rows}"
    if marker.exists():
        return uri
    shutil.rmtree(out, ignore_errors=True)
    rng = np.random.default_rng(seed)
    written = []
    for part, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        batch = _batch(min(ROWS_PER_FILE, rows - start), rng)
        written.append(
            tables.write_part(uri, f"part-{part:05d}.parquet", [batch], schemas.TOKENIZED, fs.LOCAL)
        )
    tables.commit(
        uri, schemas.TOKENIZED, written, run_id="bench", mode="overwrite", rows=rows, storage=fs.LOCAL
    )
    marker.touch()
    return uri


def hex_ids(n: int, rng: np.random.Generator) -> pa.Array:
    """``n`` random ids of 32 hex digits (128 random bits each), built without a str per row."""
    raw = rng.integers(0, 256, (n, 16), np.uint8)
    digits = np.empty((n, 32), np.uint8)
    digits[:, 0::2], digits[:, 1::2] = HEX[raw >> 4], HEX[raw & 15]
    offsets = np.arange(0, 32 * n + 1, 32, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(digits.tobytes())]
    )


def _batch(n: int, rng: np.random.Generator) -> pa.RecordBatch:
    lengths = np.clip(rng.lognormal(5.0, 0.8, n), 8, 16384).astype(np.int32)
    ids = hex_ids(n, rng)
    empty = pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.int32()))
    zeros = pa.array(np.zeros(n, np.int32))
    columns = {
        "sample_id": ids,
        "parent_id": ids,
        "dataset": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), ["bench"]).cast(
            pa.string()
        ),
        "input_ids": empty,
        "labels": empty,
        "num_tokens": pa.array(lengths),
        "text_tokens": pa.array(lengths),
        "image_tokens": zeros,
        "video_tokens": zeros,
        "supervised_tokens": pa.array(lengths - lengths // 2),
        "media": pa.ListArray.from_arrays(
            pa.array(np.zeros(n + 1, np.int32)), pa.array([], schemas.TOKENIZED_MEDIA)
        ),
        "pair_side": pa.nulls(n, pa.string()),
        "weight": pa.array(np.ones(n)),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=schemas.TOKENIZED)


class Steps:
    """The peak resident memory (GiB) and seconds of each step."""

    def __init__(self, memory: PeakMemory) -> None:
        self.memory, self.figures, self.started = memory, {}, time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        peak = max(self.memory.peak["driver"], psutil.Process().memory_info().rss)
        self.memory.peak["driver"] = 0
        self.figures[name] = {"peak_gib": round(peak / GIB, 3), "seconds": round(now - self.started, 1)}
        self.started = now


def plan(out, uri: str, steps: Steps) -> dict:
    """pack.run's driver steps, in its order, without Spark; the figures of the placement."""
    config = load_config(None, [f"output={out}", "run_id=bench-plan"])
    settings = pack.PackSettings.from_config(config)
    storage = fs.LOCAL
    snap = tables.snapshot(uri, storage)
    counts = pack.read_counts(uri, snap, storage)
    release_memory()
    steps.done("read counts")
    over = pack.check_oversize(counts, settings)
    conversations = mix.Conversations.of(counts)
    chosen = mix.choose(counts, settings.mix, excluded=over, conversations=conversations)
    release_memory()
    steps.done("oversize, conversations, mix")
    placement = pack.place(counts, settings, chosen.copies)
    release_memory()
    steps.done("place")
    folder = str(out / "placement")
    parts = pack.write_placement_parts(placement, folder, storage)
    steps.done("placement parts")
    figures = {"items": placement.items, "bins": sum(placement.shard_bins), "parts": len(parts)}
    del placement
    shutil.rmtree(folder)
    release_memory()
    pack.check_rows(counts.num_rows, mix.summary(counts, chosen, over, conversations))
    steps.done("mix summary")
    figures["tokens"] = int(pc.sum(counts.column("num_tokens")).as_py())
    figures["budget"] = settings.budget
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parse_with_smoke(parser, rows=5000)
    out = OUT / "pack-plan"
    started = time.perf_counter()
    uri = counts_table(out, args.rows)
    print(f"counts table: {args.rows:,} rows ({time.perf_counter() - started:.1f} s)")
    before = psutil.Process().memory_info().rss
    memory = PeakMemory(every=0.1)
    memory.start()
    steps = Steps(memory)
    started = time.perf_counter()
    figures = plan(out, uri, steps)
    seconds = time.perf_counter() - started
    memory.stop.set()
    memory.join()
    peak = max(step["peak_gib"] for step in steps.figures.values())
    lower_bound = -(-figures["tokens"] // figures["budget"])
    result = {
        "machine": machine(),
        "rows": args.rows,
        "seconds": round(seconds, 1),
        **figures,
        "lower_bound_bins": lower_bound,
        "fill": round(figures["tokens"] / (figures["bins"] * figures["budget"]), 6),
        "peak_driver_python_gib": peak,
        "start_gib": round(before / GIB, 3),
        "bytes_per_row": round((peak - before / GIB) * GIB / args.rows, 1),
        "steps": steps.figures,
    }
    print(json.dumps(result, indent=2))
    (OUT / f"pack_plan-{args.rows}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
