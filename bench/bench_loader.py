"""Loader throughput per worker: PackedDataset in one process (= one dataloader worker).

    .venv/bin/python bench/bench_loader.py [--s3-shards 2]

Sources (made by other steps, reused when present):
  text    bench/out/pack-spark/packed (bench_pack_spark.py: 1 M text rows, ~204 M tokens)
  images  bench/out/loader-demo/packed (`mmpack demo`, 2,000 samples with real images and
          videos; every item decoded, resized and patchified to Qwen2-VL pixel values)
Each is read from local disk and from a moto S3 server on loopback (its first
--s3-shards shards, through a manifest naming only those). Default loader settings:
shuffle (buffer 256), sha256 verification on first open. Tokens/s counts input_ids.
Results: bench/out/loader.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (
    OUT,
    SMOKE_DEMO_BUDGET,
    SMOKE_DEMO_SAMPLES,
    ensure_image_demo,
    machine,
    moto_server,
    parse_with_smoke,
)

from loader import PackedDataset


def sub_manifest(packed: Path, shards: int) -> Path:
    """A manifest beside the original that names only its first ``shards`` shards (and no cost
    index: the run's covers every shard, so the loader reads these in plain order)."""
    manifest = json.loads((packed / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:shards]
    manifest.pop("cost_index", None)
    path = packed / f"manifest-first-{shards}.json"
    path.write_text(json.dumps(manifest))
    return path


def read_all(uri: str, with_media: bool, s3: dict | None = None, limit_s: float = 60.0) -> dict:
    dataset = PackedDataset(uri, s3=s3, with_media=with_media)
    started, bins, tokens = time.perf_counter(), 0, 0
    for item in dataset:
        bins += 1
        tokens += len(item["input_ids"])
        if time.perf_counter() - started > limit_s:
            break
    seconds = time.perf_counter() - started
    return {"bins": bins, "tokens": tokens, "seconds": round(seconds, 2),
            "bins_per_s": round(bins / seconds, 1), "tokens_per_s": round(tokens / seconds)}  # fmt: skip


def upload(endpoint: str, bucket: str, packed: Path, manifest: Path) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    client.upload_file(str(manifest), bucket, "packed/manifest.json")
    for shard in json.loads(manifest.read_text())["shards"]:
        client.upload_file(str(packed / shard["path"]), bucket, f"packed/{shard['path']}")


def ensure_text_shards(rows: int) -> Path:
    """bench_pack_spark.py's text-only shards, written by running it when they are not there."""
    packed = OUT / "pack-spark" / "packed"
    if not (packed / "manifest.json").exists():
        script = Path(__file__).with_name("bench_pack_spark.py")
        subprocess.run(
            [sys.executable, str(script), "--rows", str(rows)], check=True, stdout=subprocess.DEVNULL
        )
    return packed


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--s3-shards", type=int, default=2)
    parser.add_argument("--demo-samples", type=int, default=2000, help="samples of the image demo it packs")
    parser.add_argument(
        "--text-rows", type=int, default=1_000_000, help="rows of the text shards, if not there"
    )
    parser.add_argument("--demo-budget", type=int, help="pack.budget of the image demo (default: the CLI's)")
    args = parse_with_smoke(
        parser, s3_shards=1, demo_samples=SMOKE_DEMO_SAMPLES, demo_budget=SMOKE_DEMO_BUDGET, text_rows=5000
    )
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

    images = ensure_image_demo(args.demo_samples, args.demo_budget)
    sources = {"text": ensure_text_shards(args.text_rows), "images": images}
    rows = []
    with moto_server() as endpoint:
        s3 = {"endpoint_override": endpoint, "scheme": "http", "region": "us-east-1"}
        for name, packed in sources.items():
            media = name == "images"
            rows.append({"data": name, "from": "local disk", **read_all(str(packed), media)})
            print(json.dumps(rows[-1]))
            bucket = f"bench-{name}"
            upload(endpoint, bucket, packed, sub_manifest(packed, args.s3_shards))
            remote = read_all(f"s3://{bucket}/packed", media, s3)
            rows.append({"data": name, "from": "S3 (moto, loopback)", **remote})
            print(json.dumps(rows[-1]))
    (OUT / "loader.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    print("\n| data | from | bins | tokens | bins/s | tokens/s |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['data']} | {r['from']} | {r['bins']:,} | {r['tokens']:,} | {r['bins_per_s']:,} | "
              f"{r['tokens_per_s']:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
