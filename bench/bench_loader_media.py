"""Loader throughput with media, per variant, in one process (= one dataloader worker).

    .venv/bin/python bench/bench_loader_media.py [--bins 40] [--rounds 3]

Data: bench_loader's `mmpack demo` (bench/out/loader-demo: 2,000 samples with real images
and videos) packed twice from the same tokenized tables: `pack.media: original` (the files'
bytes; the loader decodes, resizes, normalizes and patchifies) and `pack.media: prepared`
(8-bit frames already at their grid; the loader only patchifies). Variants: each packing ×
`pixel_dtype` float32 / uint8. The variants alternate for --rounds rounds over the same first
--bins bins (this machine's speed drifts over minutes); the median round is reported, with
each variant's ratio to "today": the original files read the way the loader read them before issue 18 (Pillow
decoding, float32 normalization before the patch transposes, one array per item then a
concatenation; ``todays_pixels``).
Results: bench/out/loader_media.json; copy the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import torch
from common import (
    OUT,
    SMOKE_DEMO_BUDGET,
    SMOKE_DEMO_SAMPLES,
    ensure_image_demo,
    machine,
    parse_with_smoke,
    run_cli,
    timed_tokens,
)
from PIL import Image

from loader import PackedDataset, vision
from loader import dataset as dataset_module

VARIANTS = [
    ("today", "float32"),  # original files, the loader as it was before issue 18 (todays_patches)
    ("original", "float32"),
    ("original", "uint8"),
    ("prepared", "float32"),
    ("prepared", "uint8"),
]


def packed_demo(media: str, samples: int, budget: int | None) -> Path:
    """The demo packed with ``pack.media`` = ``media``: the original run is bench_loader's demo
    (made first when missing), the prepared one its tables packed again."""
    original = ensure_image_demo(samples, budget).parent
    if media == "original":
        return original / "packed"
    out = OUT / "loader-media-prepared"
    if not (out / "packed" / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(original / "tables", out / "tables")
        config = str(original / "input" / "mmpack.yaml")
        command = ["pack", "--config", config, "--out", str(out), "--master", "local[2]"]
        command += ["--set", "pack.media=prepared"]
        if budget is not None:
            command += ["--set", f"pack.budget={budget}"]
        run_cli(command)
    return out / "packed"


def todays_patches(frames: list, item: dict, dtype: str = "float32") -> np.ndarray:
    """The loader's Qwen2-VL patches as they were computed before issue 18 (commit cf8c14a):
    each frame resized and normalized in float32, then the float32 array patchified."""
    t, h, w = item["grid_t"], item["grid_h"], item["grid_w"]
    height, width = item["resized_height"], item["resized_width"]
    normalized = []
    for frame in frames:
        resized = np.asarray(frame.resize((width, height), Image.Resampling.BICUBIC), np.float32)
        normalized.append(
            ((resized * np.float32(1 / 255) - vision.CLIP_MEAN) / vision.CLIP_STD).transpose(2, 0, 1)
        )
    pixels = np.stack(normalized)
    if len(frames) == 1:
        pixels = np.repeat(pixels, 2 * t, axis=0)
    patches = pixels.reshape(t, 2, 3, h // 2, 2, 14, w // 2, 2, 14).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(t * h * w, 1176))


def todays_pixels(media: list[dict], profile, storage, pixels) -> dict:
    """The loader's per-bin pixels as computed before issue 18: each item's float32 patches
    (``todays_patches``), then one concatenation per kind."""
    out = {}
    for kind, pixels_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        items = [m for m in media if m["kind"] == kind]
        if items:
            patches = [todays_patches(dataset_module._frames(m, storage), m) for m in items]
            out[pixels_key] = torch.from_numpy(np.concatenate(patches))
            out[grid_key] = torch.tensor([[m["grid_t"], m["grid_h"], m["grid_w"]] for m in items])
    return out


def read(packed: Path, pixel_dtype: str, bins: int, today: bool = False) -> dict:
    """Read ``bins`` bins; ``today``: with the pre-issue-18 decoding (Pillow) and pixels."""
    saved = vision.simplejpeg, dataset_module._qwen_pixels
    if today:
        vision.simplejpeg, dataset_module._qwen_pixels = None, todays_pixels
    try:
        return _read(packed, pixel_dtype, bins)
    finally:
        vision.simplejpeg, dataset_module._qwen_pixels = saved


def _read(packed: Path, pixel_dtype: str, bins: int) -> dict:
    dataset = PackedDataset(str(packed), shuffle=False, balance=False, pixel_dtype=pixel_dtype)
    return timed_tokens(len(item["input_ids"]) for item in itertools.islice(dataset, bins))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bins", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--demo-samples", type=int, default=2000, help="samples of the demo it packs")
    parser.add_argument("--demo-budget", type=int, help="pack.budget of the demo (default: the CLI's)")
    args = parse_with_smoke(
        parser, bins=4, rounds=1, demo_samples=SMOKE_DEMO_SAMPLES, demo_budget=SMOKE_DEMO_BUDGET
    )
    packed = {m: packed_demo(m, args.demo_samples, args.demo_budget) for m in ("original", "prepared")}
    packed["today"] = packed["original"]
    sizes = {}
    for media, root in packed.items():
        manifest = json.loads((root / "manifest.json").read_text())
        totals = manifest["totals"]
        sizes[media] = {
            "bytes": totals["bytes"],
            "bytes_per_token": round(totals["bytes"] / totals["tokens"], 3),
        }
    rounds = []
    for _ in range(args.rounds):
        rounds.append({f"{m}+{d}": read(packed[m], d, args.bins, m == "today") for m, d in VARIANTS})
    baseline = "today+float32"
    summary = {}
    for media, dtype in VARIANTS:
        name = f"{media}+{dtype}"
        ratios = [r[name]["tokens_per_s"] / r[baseline]["tokens_per_s"] for r in rounds]
        summary[name] = {
            "median_tokens_per_s": statistics.median(r[name]["tokens_per_s"] for r in rounds),
            "median_ratio_to_today": round(statistics.median(ratios), 2),
            "shard_bytes": sizes["original" if media == "today" else media]["bytes"],
            "shard_bytes_per_token": sizes["original" if media == "today" else media]["bytes_per_token"],
        }
    report = {"machine": machine(), "bins_per_variant": args.bins, "rounds": rounds, "summary": summary}
    (OUT / "loader_media.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
