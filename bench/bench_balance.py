"""Straggler overhead of today's order vs the balanced plan, and planning time.

Cases: (a) the demo's cost index (``mmpack demo`` output, if present), (b) a synthetic
InternVL-style mix (text + 1–6 tiles of 256 tokens, samples of 100–2,500 tokens, budget
8,192), with and without a second budget of 24 tiles per bin, (c) a long-context mix
(budget 32,768, half the tokens in Qwen2-VL videos of 2 k–30 k tokens). Synthetic bins are
packed and laid out as the pack job does (one first-fit-decreasing, cost-stratified row
groups of 32 bins, shards of 2,048). World sizes 8, 64, 256; 1 and 4
micro-batches per step; one reader per rank.

    .venv/bin/python bench/bench_balance.py [--demo-out demo-out] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, parse_with_smoke
from loader import balance, plan
from mmpack_udfs import config as mmconfig
from mmpack_udfs.constants import VISION_PATCHES_PER_TOKEN
from mmpack_udfs.pack import costs
from mmpack_udfs.pack.ffd import first_fit_decreasing

TILE = 256  # InternVL tokens per tile
VIDEO_FRAME_PATCHES = 26 * 46  # a 364 x 644 frame: 1,196 patches of 14 px per temporal patch


def internvl_mix(samples: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tiles = np.where(rng.random(samples) < 0.3, 0, rng.integers(1, 7, samples))
    length = np.exp(rng.uniform(np.log(100), np.log(2500), samples)).astype(np.int64)
    length = np.maximum(length, tiles * TILE + 20)
    tile_patches = TILE * VISION_PATCHES_PER_TOKEN
    return {"tokens": length, "patches": tiles * tile_patches, "sq_patches": tiles * tile_patches**2}


def long_context_mix(samples: int, seed: int) -> dict[str, np.ndarray]:
    """Half the tokens in videos (2 k–30 k tokens), half in text samples (100–6 k tokens)."""
    rng = np.random.default_rng(seed)
    video = rng.random(samples) < 0.25
    wanted = np.exp(rng.uniform(np.log(2000), np.log(30000), samples))
    grid_t = np.maximum((wanted * VISION_PATCHES_PER_TOKEN / VIDEO_FRAME_PATCHES).astype(np.int64), 1)
    video_tokens = grid_t * VIDEO_FRAME_PATCHES // VISION_PATCHES_PER_TOKEN
    text = np.exp(rng.uniform(np.log(100), np.log(6000), samples)).astype(np.int64)
    tokens = np.where(video, video_tokens + rng.integers(50, 500, samples), text)
    patches = np.where(video, grid_t * VIDEO_FRAME_PATCHES, 0)
    return {
        "tokens": tokens,
        "patches": patches,
        "sq_patches": np.where(video, grid_t * VIDEO_FRAME_PATCHES**2, 0),
    }


def pack_like_mmpack(
    samples: dict[str, np.ndarray],
    budget: int,
    model: costs.CostModel,
    second_budget: int | None = None,
    per_shard: int = 2048,
    per_row_group: int = 32,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(cost index columns, bins per row group) in manifest order, as the pack job makes
    them: one first-fit-decreasing, bins in cost-stratified row groups, shards of 2,048."""
    second = samples["patches"] if second_budget else None
    packing = first_fit_decreasing(
        samples["tokens"], budget, second=second, second_budget=second_budget, oversize="skip"
    )
    vision_tokens = samples["patches"] // VISION_PATCHES_PER_TOKEN
    figures = costs.bin_figures(
        packing.bin_of, packing.num_bins, samples["tokens"], vision_tokens, samples["sq_patches"]
    )
    order = costs.write_order(figures, model, per_row_group, seed)
    sizes = []
    for first in range(0, len(order), per_shard):
        rows = min(per_shard, len(order) - first)
        sizes += [min(per_row_group, rows - i) for i in range(0, rows, per_row_group)]
    return {k: v[order] for k, v in figures.items()}, np.array(sizes, np.int64)


def demo_index(out: Path) -> tuple[dict[str, np.ndarray], np.ndarray, str] | None:
    manifest_path = out / "packed" / "manifest.json"
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    table = costs.read_index(str(out / "packed"), manifest, None)
    sizes = [u.rows for u in plan.units_of(manifest["shards"], manifest["bins_per_row_group"])]
    index = {name: table[name].to_numpy() for name in table.column_names}
    return index, np.array(sizes, np.int64), manifest["profile"]


def measure(index: dict, sizes: np.ndarray, model: costs.CostModel, world: int, k: int) -> dict:
    vision, llm = model.phases(index)
    return balance.compare(vision, llm, sizes, world, k)


def planning_seconds(index: dict, sizes: np.ndarray, model: costs.CostModel, bins: int, world: int) -> tuple:
    """Time to plan one epoch of about ``bins`` bins (the index repeated)."""
    copies = -(-bins // int(sizes.sum()))
    big = {k: np.tile(v, copies) for k, v in index.items()}
    big_sizes = np.tile(sizes, copies)
    vision, llm = model.phases(big)
    started = time.perf_counter()
    balance.balanced_plan(vision, llm, big_sizes, world, seed=0, epoch=1)
    return int(big_sizes.sum()), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-out", type=Path, default=Path("demo-out"))
    parser.add_argument("--samples", type=int, default=400_000, help="synthetic samples for (b)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--planning-bins", type=int, default=1_000_000, help="bins of the planning timing")
    args = parse_with_smoke(parser, samples=3000, planning_bins=5000, demo_out=Path("no-demo"))
    defaults = mmconfig.load_config()
    model = {name: costs.CostModel.for_profile(defaults, name) for name in ("qwen2_vl", "internvl")}
    cases = {}
    demo = demo_index(args.demo_out)
    if demo is not None:
        cases["a demo"] = (demo[0], demo[1], model[demo[2]])
    mix = internvl_mix(args.samples, seed=1)
    cases["b internvl, 24-tile budget"] = (
        *pack_like_mmpack(mix, 8192, model["internvl"], 24 * TILE * 4),
        model["internvl"],
    )
    cases["b internvl"] = (*pack_like_mmpack(mix, 8192, model["internvl"]), model["internvl"])
    cases["c long-context"] = (
        *pack_like_mmpack(long_context_mix(args.samples, seed=2), 32768, model["qwen2_vl"]),
        model["qwen2_vl"],
    )
    results = []
    for name, (index, sizes, cost_model) in cases.items():
        for world in (8, 64, 256):
            for k in (1, 4):
                row = {"case": name, "bins": int(sizes.sum()), "world_size": world, "micro_batches": k}
                row.update(measure(index, sizes, cost_model, world, k))
                results.append(row)
                if not args.json:
                    r, b = row["random"], row["balanced"]
                    print(
                        f"{name:28s} bins {row['bins']:7d} R {world:3d} k {k} | "
                        + " | ".join(
                            f"{label} vision {p['overhead_vision']:.2%} llm {p['overhead_llm']:.2%} "
                            f"step {p['overhead_step']:.2%} read {p['read_amplification']:.3f}"
                            for label, p in (("random", r), ("balanced", b))
                        ),
                        flush=True,
                    )
    index, sizes, cost_model = cases["b internvl, 24-tile budget"]
    bins, seconds = planning_seconds(index, sizes, cost_model, args.planning_bins, 64)
    summary = {
        "machine": machine(),
        "results": results,
        "planning": {"bins": bins, "world_size": 64, "seconds": seconds},
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"planning one epoch of {bins:,} bins for 64 ranks: {seconds:.2f} s ({machine()})")


if __name__ == "__main__":
    main()
