"""Normalize throughput on local Spark: records/s at several dataset sizes.

    .venv/bin/python bench/bench_normalize.py --sizes 10000 100000 [--master local[2]]

For each size it generates demo data (seed 0, one image file per ~10 records, real
JPEG/PNG/MP4/AVI media), runs the normalize job with media probing into a fresh output
directory and prints records/s. Data generation is not timed. Results go to
bench/out/normalize.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from common import OUT, bench_spark, machine, parse_with_smoke

from mmpack_udfs.config import load_config
from mmpack_udfs.context import RunContext
from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import stage as normalize


def run_size(spark, samples: int, master: str) -> dict:
    data_dir = OUT / f"normalize-data-{samples}"
    started = time.time()
    demo = demo_data.generate(data_dir, samples=samples, seed=0, media_pool=min(samples // 10, 10000))
    generated = time.time() - started
    out = OUT / f"normalize-out-{samples}"
    shutil.rmtree(out, ignore_errors=True)
    config = load_config(demo.config, [f"output={out}"])
    started = time.time()
    summary = normalize.run(spark, RunContext.of(config))
    seconds = time.time() - started
    media = sum(1 for p in (data_dir / "media").rglob("*") if p.is_file())
    return {
        "records": summary["totals"]["read"],
        "samples": summary["totals"]["samples"],
        "quarantined": summary["totals"]["quarantined"],
        "media_files": media,
        "seconds": round(seconds, 2),
        "records_per_s": round(summary["totals"]["read"] / seconds, 1),
        "generate_seconds": round(generated, 1),
        "master": master,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 100000])
    parser.add_argument("--master", default="local[2]")
    args = parse_with_smoke(parser, sizes=[200])
    spark = bench_spark(args.master)
    results = [run_size(spark, n, args.master) for n in args.sizes]
    machine_line = machine()
    report = {"machine": machine_line, "spark": spark.version, "results": results}
    (OUT / "normalize.json").write_text(json.dumps(report, indent=2))
    print(f"machine: {machine_line}; Spark {spark.version}")
    print("| records | media files | seconds | records/s |")
    print("|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['records']} | {r['media_files']} | {r['seconds']} | {r['records_per_s']} |")


if __name__ == "__main__":
    main()
