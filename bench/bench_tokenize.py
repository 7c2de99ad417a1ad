"""Tokenize-stage throughput on local Spark, side by side with the raw tokenizer.

    .venv/bin/python bench/bench_tokenize.py --samples 190000 [--master local[2]]

1. Generates demo data and normalizes it (not timed) into bench/out/tokenize-run.
2. Times the tokenize stage (`tokenize.run`: plan, Spark tasks that read samples,
   render, encode, assemble and write Parquet, two Delta commits, statistics).
3. Renders the same samples on the driver and times the raw tokenizer on exactly the
   texts the stage encodes: `Tokenizer.encode_batch` with 2 threads, in a fresh process
   (TOKENIZERS_PARALLELISM=true, RAYON_NUM_THREADS=2).

Throughput is encoded text tokens per second, the same count on both sides (media pad and
special tokens cost the tokenizer nothing; the stage's total including them is reported too).
Results: bench/out/tokenize.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time

from common import OUT, bench_spark, machine

from mmpack_udfs import demo_data, tables
from mmpack_udfs.config import load_config
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.stages import normalize, tokenize
from mmpack_udfs.tokenization import SampleTokenizer, TokenizeSettings

RAW = """
import json, pickle, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
texts = pickle.load(open(sys.argv[2], "rb"))
tok.encode_batch(texts[:2000], add_special_tokens=False)
result = {}
for name in ("encode_batch", "encode_batch_fast"):
    runs = []
    for _ in range(int(sys.argv[3])):
        started = time.perf_counter()
        encodings = getattr(tok, name)(texts, add_special_tokens=False)
        runs.append(time.perf_counter() - started)
        result["tokens"] = sum(len(e.ids) for e in encodings)
        del encodings
    result[name] = runs
print(json.dumps(result))
"""


def raw_tokenizer(settings: TokenizeSettings, samples_uri: str, repeat: int) -> dict:
    tokenizer = SampleTokenizer(settings)
    texts = []
    for row in tables.read_arrow(samples_uri).to_pylist():
        try:
            plans = [tokenizer.profile.plan(m) for m in row["media"]]
        except Exception:
            continue  # quarantined by the stage too
        texts += [p.text for p in tokenizer.render(row["system"], row["turns"], plans) if p.text]
    path = OUT / "tokenize-texts.pkl"
    path.write_bytes(pickle.dumps(texts))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", RAW, settings.tokenizer_path, str(path), str(repeat)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=190000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each side; the best is compared")
    args = parser.parse_args()
    spark = bench_spark(args.master, driver_memory="6g")
    data = demo_data.generate(
        OUT / f"tokenize-data-{args.samples}", samples=args.samples, seed=0, media_pool=2000
    )
    out = OUT / "tokenize-run"
    config = load_config(data.config, [f"output={out}"])
    normalize.run(spark, config)

    stage_runs = []
    for _ in range(args.repeat):
        config = load_config(data.config, [f"output={out}", f"run_id=bench-{time.time_ns()}"])
        started = time.perf_counter()
        summary = tokenize.run(spark, config)
        stage_runs.append((time.perf_counter() - started, summary["task_seconds"]))
    stage_seconds, task_seconds = min(stage_runs)
    tokens = summary["tokens"]

    raw = raw_tokenizer(TokenizeSettings.from_config(config), table_uri(str(out), "samples"), args.repeat)
    raw_seconds = min(raw["encode_batch"])
    # The stage encodes exactly these texts (and adds literal special and media pad ids).
    stage_rate, raw_rate = raw["tokens"] / stage_seconds, raw["tokens"] / raw_seconds
    report = {
        "machine": machine(),
        "spark": spark.version,
        "master": args.master,
        "samples": summary["counts"]["samples_in"],
        "encoded_text_tokens": raw["tokens"],
        "text_tokens_with_specials": tokens["text"],
        "all_tokens": tokens["total"],
        "stage_seconds_runs": [round(s, 2) for s, _ in stage_runs],
        "stage_task_seconds_best_run": task_seconds,
        "stage_text_tokens_per_s": round(stage_rate),
        "stage_all_tokens_per_s": round(tokens["total"] / stage_seconds),
        "raw_encode_batch_seconds_runs": [round(s, 2) for s in raw["encode_batch"]],
        "raw_encode_batch_tokens_per_s": round(raw_rate),
        "raw_encode_batch_fast_seconds_runs": [round(s, 2) for s in raw["encode_batch_fast"]],
        "ratio_stage_to_encode_batch": round(stage_rate / raw_rate, 3),
    }
    (OUT / "tokenize.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
