"""End to end on demo data with realistic media use (``--media-reuse``: the fraction of media
references that repeat a file already used; 0.1 by default, so most images appear once).

Reports per stage (normalize, tokenize, pack) the wall time and samples per second per core,
the shard bytes per token, the peak resident memory of each process kind (driver Python,
JVM, the largest Python worker, all Python workers together), and the decode-bound limit:
the time to decode every unique image once with Pillow's reduced-scale draft, per core; and
the media bound: that plus every frame of every unique video decoded once (OpenCV, one thread),
as normalize counts a video's frames.

    .venv/bin/python bench/bench_end_to_end.py --samples 100000 --media-reuse 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

from common import OUT, PeakMemory, bench_spark, machine, parse_with_smoke
from PIL import Image

from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import media
from mmpack_udfs.normalize import stage as normalize
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize import stage as tokenize

STAGES = {"normalize": normalize.run, "tokenize": tokenize.run, "pack": pack.run}


def decode_bound_seconds(media_root: Path) -> tuple[int, float]:
    """Every image under ``media_root`` decoded once, at the smallest draft scale Pillow's
    JPEG decoder offers (PNGs decode in full): (images, seconds on one core)."""
    files = sorted(p for p in (media_root / "images").iterdir() if p.suffix in (".jpg", ".png"))
    started = time.perf_counter()
    for path in files:
        with Image.open(path) as image:
            image.draft("RGB", (max(image.width // 8, 1), max(image.height // 8, 1)))
            image.load()
    return len(files), time.perf_counter() - started


def video_decode_seconds(media_root: Path) -> tuple[int, float]:
    """Every frame of every video under ``media_root`` decoded once, in order, on one thread, as
    normalize counts the frames that decode: (videos, seconds on one core)."""
    files = sorted((media_root / "videos").iterdir())
    started = time.perf_counter()
    for path in files:
        capture = media.open_video(str(path))
        while capture.grab():
            pass
        capture.release()
    return len(files), time.perf_counter() - started


def demo_dataset(root: Path, samples: int, media_reuse: float) -> Path:
    """The demo data's config, generated on the first run of these settings and reused."""
    done = root / ".complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        demo_data.generate(root, samples=samples, seed=0, media_reuse=media_reuse)
        done.write_text("ok")
    return root / "mmpack.yaml"


def cores(master: str) -> int:
    found = re.fullmatch(r"local\[(\d+|\*)\]", master)
    if not found:
        raise SystemExit(f"--master must be local[N] here, not {master}")
    return (os.cpu_count() or 1) if found.group(1) == "*" else int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100000)
    parser.add_argument("--media-reuse", type=float, default=0.1)
    parser.add_argument("--master", default="local[2]")
    args = parse_with_smoke(parser, samples=200)
    n_cores = cores(args.master)
    root = OUT / f"e2e-{args.samples}-reuse{args.media_reuse}"
    data_dir, out = root / "input", root / "out"
    started = time.perf_counter()
    config = demo_dataset(data_dir, args.samples, args.media_reuse)
    generate_seconds = time.perf_counter() - started

    spark = bench_spark(args.master, driver_memory="4g")
    shutil.rmtree(out, ignore_errors=True)
    ctx = load_run(config, [f"output={out}", f"run_id=bench-{time.time_ns()}"])
    stages = {}
    for name, run in STAGES.items():
        memory = PeakMemory()
        memory.start()
        started = time.perf_counter()
        run(spark, ctx)
        seconds = time.perf_counter() - started
        memory.stop.set()
        memory.join()
        stages[name] = {
            "seconds": round(seconds, 1),
            "samples_per_s_per_core": round(args.samples / seconds / n_cores, 1),
            "peak_memory_gib": memory.gib(),
        }

    images, decode_seconds = decode_bound_seconds(data_dir / "media")
    videos, video_seconds = video_decode_seconds(data_dir / "media")
    totals = json.loads((out / "packed" / "manifest.json").read_text())["totals"]
    report = {
        "machine": machine(),
        "spark": spark.version,
        "master": args.master,
        "samples": args.samples,
        "media_reuse": args.media_reuse,
        "unique_images": images,
        "unique_videos": videos,
        "media_bytes": sum(p.stat().st_size for p in (data_dir / "media").rglob("*") if p.is_file()),
        "generate_seconds_or_reused": round(generate_seconds, 1),
        "stages": stages,
        "total_seconds": round(sum(s["seconds"] for s in stages.values()), 1),
        "shard_bytes_per_token": round(totals["bytes"] / totals["tokens"], 3),
        "tokens": totals["tokens"],
        "fill": totals["fill"],
        "decode_bound": {
            "seconds_one_core": round(decode_seconds, 1),
            "samples_per_s_per_core": round(args.samples / decode_seconds, 1),
        },
        "media_bound": {
            "seconds_one_core": round(decode_seconds + video_seconds, 1),
            "samples_per_s_per_core": round(args.samples / (decode_seconds + video_seconds), 1),
        },
        "peak_memory_gib": {
            kind: max(stage["peak_memory_gib"][kind] for stage in stages.values())
            for kind in ("driver", "jvm", "worker", "workers")
        },
    }
    (OUT / f"end_to_end-{args.samples}-reuse{args.media_reuse}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
