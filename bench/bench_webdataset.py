"""WebDataset input: a normalize worker's peak memory as the tar grows (it must stay flat).

    .venv/bin/python bench/bench_webdataset.py --sizes-mb 64 1024 4096     # make bench-webdataset

For each size it writes one tar of keys (a JSON record and a JPEG of real pixels each, from
a pool of 64 distinct images), then runs in a fresh Python process exactly what a Spark
task of the normalize stage runs on it: the split read as a stream
(``inputs.read_splits_batches``), every record normalized and its media probed
(``records.normalize_batches``). It prints that process's peak resident memory and its
throughput (the pool's images are probed once each: reading, hashing and handing over).
Results go to bench/out/webdataset.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from common import OUT, machine, parse_with_smoke
from PIL import Image

from mmpack_udfs.normalize import inputs, media, records
from mmpack_udfs.normalize.sharegpt import DatasetSpec

MB = 1 << 20
POOL = 64


def image_pool(seed: int = 0) -> list[bytes]:
    """JPEGs of noisy gradients, 384-640 px a side (about 60-200 KB each)."""
    rng = random.Random(seed)
    pool = []
    for _ in range(POOL):
        width, height = rng.randrange(384, 641), rng.randrange(384, 641)
        noise = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (height, width, 3), np.uint8)
        out = io.BytesIO()
        Image.fromarray(noise).save(out, format="JPEG", quality=85)
        pool.append(out.getvalue())
    return pool


def write_tar(path: Path, size_mb: int) -> int:
    """A tar of about ``size_mb`` MB; its number of keys."""
    pool, written, key = image_pool(), 0, 0
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        while written < size_mb * MB:
            image = pool[key % POOL]
            record = {"conversations": [{"from": "human", "value": f"<image> What is {key}?"},
                                        {"from": "gpt", "value": "Noise."}]}  # fmt: skip
            for name, data in ((f"{key:08d}.jpg", image), (f"{key:08d}.json", json.dumps(record).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            written += len(image) + 2048
            key += 1
    return key


def read_as_a_task(tar: Path, media_dir: Path) -> dict:
    """What one normalize task does with the tar; rows out and this process's peak memory."""
    spec = DatasetSpec(name="w", paths=(str(tar),), media_root=str(tar.parent))
    specs = {"w": spec}
    (split,) = inputs.plan_splits(inputs.list_inputs([spec]), 1 << 30)
    settings = records.NormalizeSettings(media.ProbeSettings(), media_dir=str(media_dir))
    started = time.perf_counter()
    raw = inputs.read_splits_batches(iter([inputs.splits_table([split]).to_batches()[0]]), specs=specs)
    counts = {"samples": 0, "quarantined": 0, "records_read": 0}
    for batch in records.normalize_batches(raw, specs, settings):
        kinds = batch.column("kind").to_pylist()
        counts["samples"] += kinds.count("sample")
        counts["quarantined"] += kinds.count("quarantine")
        counts["records_read"] += int(pc.sum(batch.column("records_read")).as_py() or 0)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**counts, "seconds": round(seconds, 2), "peak_rss_mb": round(peak_mb, 1)}


def run_size(size_mb: int) -> dict:
    tar = OUT / "webdataset" / f"shard-{size_mb}mb.tar"
    tar.parent.mkdir(parents=True, exist_ok=True)
    keys = write_tar(tar, size_mb)
    child = subprocess.run(
        [sys.executable, __file__, "--read", str(tar)], capture_output=True, text=True, check=True
    )
    result = json.loads(child.stdout.strip().splitlines()[-1])
    tar_mb = tar.stat().st_size / MB
    tar.unlink()  # gigabytes of bench/out for nothing
    assert result["records_read"] == keys == result["samples"], (keys, result)
    speed = round(tar_mb / result["seconds"], 1)
    return {"tar_mb": round(tar_mb, 1), "keys": keys, **result, "mb_per_s": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--read", help=argparse.SUPPRESS)  # the child: read one tar as a task
    args = parse_with_smoke(parser, sizes_mb=[2, 6])
    if args.read:
        tar = Path(args.read)
        print(json.dumps(read_as_a_task(tar, tar.parent / f"media-{tar.stem}")))
        return
    results = [run_size(size) for size in args.sizes_mb]
    report = {"machine": machine(), "results": results}
    (OUT / "webdataset.json").write_text(json.dumps(report, indent=2))
    print(f"machine: {report['machine']}")
    print(f"{'tar MB':>8}{'keys':>8}{'seconds':>9}{'MB/s':>7}{'peak RSS MB':>13}")
    for r in results:
        print(f"{r['tar_mb']:>8}{r['keys']:>8}{r['seconds']:>9}{r['mb_per_s']:>7}{r['peak_rss_mb']:>13}")


if __name__ == "__main__":
    main()
