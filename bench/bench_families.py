"""Tokenize-stage throughput per model family, on the same demo samples.

    .venv/bin/python bench/bench_families.py --samples 50000 --rounds 3 [--master local[2]] [--families ...]

1. Generates demo data and normalizes it once (not timed) into bench/out/families-run.
2. Builds a model directory per family (--families, all three by default; the smoke run: one)
   from tests/models (published processor configs and chat templates, real vocabularies).
3. Times the tokenize stage (`tokenize.run`, Spark tasks to committed Delta tables) for
   the built-in `qwen2_vl` profile and each family's `tokenize.model`, interleaved for
   --rounds rounds (the machine's speed drifts over minutes); reports the best round of
   each: samples/s and tokens/s, and each family's ratio to qwen2_vl's samples/s.

Families tokenize the same samples into different numbers of tokens (patch 16 vs 14,
timestamps), so samples/s is the comparison; tokens/s is reported beside it.
Results: bench/out/families.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import OUT, bench_spark, machine, parse_with_smoke

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import stage as normalize
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize import stage as tokenize
from tests.models.build import build_model_dir

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=50000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    args = parse_with_smoke(parser, samples=40, rounds=1, families=["qwen3_5"])
    spark = bench_spark(args.master, driver_memory="6g")
    root = OUT / f"families-data-{args.samples}"
    if (root / ".complete").exists():
        data = demo_data.DemoData(root, root / "mmpack.yaml", 0, 0, 0, 0)
    else:
        data = demo_data.generate(root, samples=args.samples, seed=0, media_pool=min(2000, args.samples))
        (root / ".complete").write_text("ok")
    out = OUT / "families-run"
    normalize.run(spark, load_run(data.config, [f"output={out}"]))
    models = OUT / "families-models"
    settings = {"qwen2_vl": []}
    for name in args.families:
        if not (models / name / "config.json").exists():
            build_model_dir(name, models / name)
        settings[name] = [f"tokenize.model={models / name}"]
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, overrides in settings.items():
            ctx = load_run(data.config, [f"output={out}", f"run_id=bench-{time.time_ns()}", *overrides])
            started = time.perf_counter()
            summary = tokenize.run(spark, ctx)
            seconds = time.perf_counter() - started
            results[name].append(
                {
                    "seconds": round(seconds, 2),
                    "samples": summary["counts"]["samples_in"],
                    "tokens": summary["tokens"]["total"],
                    "text_tokens": summary["tokens"]["text"],
                }
            )
    best = {name: min(runs, key=lambda r: r["seconds"]) for name, runs in results.items()}
    base = best["qwen2_vl"]["samples"] / best["qwen2_vl"]["seconds"]
    table = {
        name: {
            "best_seconds": r["seconds"],
            "samples_per_s": round(r["samples"] / r["seconds"]),
            "tokens_per_s": round(r["tokens"] / r["seconds"]),
            "text_tokens": r["text_tokens"],
            "ratio_to_qwen2_vl": round(r["samples"] / r["seconds"] / base, 3),
        }
        for name, r in best.items()
    }
    report = {
        "machine": machine(),
        "master": args.master,
        "samples": args.samples,
        "rounds": results,
        "best": table,
    }
    (OUT / "families.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
