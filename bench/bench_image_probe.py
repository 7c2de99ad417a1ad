"""Normalize's image probe per file, with its fast checks (JPEGs through libjpeg-turbo, PNGs'
image data through zlib-ng) and with Pillow's decode alone, on the demo's drawings at its
image sizes, one core.

    .venv/bin/python bench/bench_image_probe.py --images 300
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time
from collections.abc import Callable
from unittest import mock

from common import OUT, machine, parse_with_smoke

from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import media, png

SETTINGS = media.ProbeSettings()


def drawings(count: int, image_format: str) -> list[bytes]:
    """``count`` demo drawings of the demo's sizes, encoded as the demo encodes them."""
    rng, files = random.Random(0), []
    for _ in range(count):
        out = io.BytesIO()
        image = demo_data._drawing(*rng.choice(demo_data.IMAGE_SIZES), rng)
        image.save(out, image_format, **({"quality": 85} if image_format == "JPEG" else {}))
        files.append(out.getvalue())
    return files


def ms_per_file(probe: Callable[[str, bytes, media.ProbeSettings], object], files: list[bytes]) -> float:
    """The best of three passes over ``files``, in milliseconds per file."""
    passes = []
    for _ in range(3):
        started = time.perf_counter()
        for data in files:
            probe("x", data, SETTINGS)
        passes.append((time.perf_counter() - started) / len(files) * 1e3)
    return round(min(passes), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=300, help="drawings per format")
    args = parse_with_smoke(parser, images=4)
    report = {"machine": machine(), "images_per_format": args.images}
    for image_format in ("PNG", "JPEG"):
        files = drawings(args.images, image_format)
        with_checks = ms_per_file(media._probe_image, files)
        with mock.patch.object(png, "zlib_ng", None):
            pillow_alone = ms_per_file(media._probe_with_pillow, files)
        report[image_format] = {
            "mean_file_bytes": round(sum(map(len, files)) / len(files)),
            "ms_per_file": with_checks,
            "ms_per_file_pillow_alone": pillow_alone,
            "times_faster": round(pillow_alone / with_checks, 1),
        }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "image_probe.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
