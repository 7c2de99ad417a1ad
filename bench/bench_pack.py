"""Packing algorithm benchmark: mmpack's FFD on 10 M lengths, and side by side on 1 M of
the same lengths with TRL's ``pack_dataset(strategy="bfd")`` and plain padding.

    .venv/bin/python bench/bench_pack.py --items 10000000 --compare 1000000 --budget 16384

The synthetic length mix (seeded; `synthetic_lengths`), budget 16,384:
  70 % text-only samples:  lognormal(mean log 6.0, sigma 1.0) tokens, clipped to [16, 16384]
  20 % image samples:      text as above + 1-4 images × 64-1,280 tokens each
  10 % video samples:      text as above + one video of 1,000-12,000 tokens
  every sample capped at the budget (mean ≈ 1,650 tokens).

Contenders on the 1 M lengths, all in this process:
  mmpack FFD             first_fit_decreasing over all lengths (what one pack group does)
  TRL bfd (default)      trl.pack_dataset(strategy="bfd"): best-fit-decreasing inside each
                         datasets.map batch of 1,000 rows (TRL's default window)
  TRL bfd (one window)   the same with map batch_size=None: one global window
  padding                batches of floor(budget / mean length) samples in input order,
                         each padded to its longest sample
TRL gets real list columns, with uint8 token values: 1 M samples of int32 tokens (6.6 GB)
and TRL's copies of them do not fit in this machine's 24 GiB; its packing decisions
read list lengths only, and its time is mostly its per-item Python loop.
Fill = real tokens / (bins × budget) (padding: / Σ batch size × longest). The FFD timing
runs on one core (the kernel is single-threaded; NUMBA_NUM_THREADS=1).
Results: bench/out/pack.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from common import OUT, machine, parse_with_smoke

from mmpack_udfs.pack.ffd import first_fit_decreasing


def synthetic_lengths(n: int, budget: int = 16384, seed: int = 0) -> np.ndarray:
    """The documented text/image/video mix (module docstring)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, n, p=[0.7, 0.2, 0.1])
    text = np.clip(rng.lognormal(6.0, 1.0, n), 16, budget).astype(np.int64)
    images = rng.integers(1, 5, n) * rng.integers(64, 1281, n)
    video = rng.integers(1000, 12001, n)
    lengths = text + np.where(kind == 1, images, 0) + np.where(kind == 2, video, 0)
    return np.minimum(lengths, budget)


def figures(name: str, seconds: float, bins: int, tokens: int, capacity: int, budget: int) -> dict:
    lower_bound = -(-tokens // budget)
    return {
        "method": name,
        "seconds": round(seconds, 3),
        "bins": int(bins),
        "lower_bound": int(lower_bound),
        "fill": round(tokens / capacity, 6),
        "over_lower_bound_pct": round(100 * (bins - lower_bound) / lower_bound, 4),
    }


def bench_ffd(lengths: np.ndarray, budget: int, repeats: int = 3) -> dict:
    first_fit_decreasing(lengths[:1000], budget)  # compile (or load numba's cache)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        packing = first_fit_decreasing(lengths, budget)
        times.append(time.perf_counter() - started)
    tokens = int(lengths.sum())
    return figures("mmpack FFD", min(times), packing.num_bins, tokens, packing.num_bins * budget, budget)


def bench_trl(lengths: np.ndarray, budget: int, window: int | None) -> dict:
    import datasets
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import pack_dataset

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = pa.array(np.zeros(int(offsets[-1]), np.uint8))  # see the module docstring
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), values)})
    datasets.disable_progress_bars()
    dataset = Dataset(InMemoryTable(table))
    started = time.perf_counter()
    packed = pack_dataset(
        dataset, budget, strategy="bfd", map_kwargs={"batch_size": window, "keep_in_memory": True}
    )
    seconds = time.perf_counter() - started
    bins = len(packed)
    tokens = int(np.asarray(packed.data.column("seq_lengths").combine_chunks().flatten()).sum())
    name = f"TRL bfd (window {window:,})" if window else "TRL bfd (one window)"
    return figures(name, seconds, bins, tokens, bins * budget, budget)


def bench_padding(lengths: np.ndarray, budget: int) -> dict:
    per_batch = max(1, budget // int(lengths.mean()))
    started = time.perf_counter()
    usable = len(lengths) - len(lengths) % per_batch
    longest = lengths[:usable].reshape(-1, per_batch).max(axis=1)
    capacity = int(longest.sum()) * per_batch
    if usable < len(lengths):
        capacity += int(lengths[usable:].max()) * (len(lengths) - usable)
    seconds = time.perf_counter() - started
    batches = -(-len(lengths) // per_batch)
    result = figures(f"padding ({per_batch}/batch)", seconds, batches, int(lengths.sum()), capacity, budget)
    result["lower_bound"] = result["over_lower_bound_pct"] = None  # batches are not budget bins
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=10_000_000)
    parser.add_argument("--compare", type=int, default=1_000_000)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--skip-trl", action="store_true")
    args = parse_with_smoke(parser, items=20_000, compare=5_000)

    lengths = synthetic_lengths(args.items, args.budget)
    print(f"{args.items:,} lengths, mean {lengths.mean():.0f}, budget {args.budget}")
    big = {"items": args.items, **bench_ffd(lengths, args.budget)}
    print(json.dumps(big))
    compare = lengths[: args.compare].copy()
    del lengths
    rows = [bench_ffd(compare, args.budget)]
    if not args.skip_trl:
        rows += [bench_trl(compare, args.budget, 1000), bench_trl(compare, args.budget, None)]
    rows.append(bench_padding(compare, args.budget))
    for row in rows:
        print(json.dumps(row))
    OUT.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(),
        "budget": args.budget,
        "ffd_large": big,
        "compare_items": args.compare,
        "compare": rows,
    }
    (OUT / "pack.json").write_text(json.dumps(result, indent=2))
    print("\n| method | seconds | bins | lower bound | fill |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        bound = row["lower_bound"] or "–"
        fill = 100 * row["fill"]
        print(f"| {row['method']} | {row['seconds']} | {row['bins']:,} | {bound} | {fill:.2f} % |")


if __name__ == "__main__":
    main()
