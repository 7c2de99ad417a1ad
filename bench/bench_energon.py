"""The Energon export and its loader: export throughput against the pack stage's, Energon's
loader against PackedDataset, and what Energon's order costs in straggling.

    .venv/bin/python bench/bench_energon.py [--demo-samples 2000] [--world-sizes 8 32]

Data: the image demo (`mmpack demo`, real images and videos, packed for Qwen2-VL; bench_loader's,
made once under bench/out/loader-demo). In one local[2] SparkSession:
  pack     the demo's tokenized table packed again into a fresh root (the pack stage, timed;
           not in the smoke run, which exports the demo's own pack)
  export   that pack exported (`mmpack export energon`, timed): bins/s and MB/s written, each
Loaders, one process each (= one dataloader worker), one epoch, with pixels (float32):
  PackedDataset + megatron_batch      vs      Energon's loader + MmpackTaskEncoder
Straggling at each world size (2 loader workers per rank, one micro-batch per step): Σ over
steps of the slowest rank's cost / Σ of the mean rank's − 1, the cost model of the profile,
for Energon's one-epoch order (contiguous shares, EqualSteps fillers), PackedDataset's
order without balancing and its balanced plan (loader.balance).
Results: bench/out/energon.json; copy the tables into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from common import (
    OUT,
    SMOKE_DEMO_BUDGET,
    SMOKE_DEMO_SAMPLES,
    bench_spark,
    ensure_image_demo,
    machine,
    parse_with_smoke,
    timed_tokens,
)

from loader import PackedDataset, balance
from loader.energon import EqualSteps, MmpackTaskEncoder, epoch_loader, load_export, steps_per_rank
from loader.megatron import megatron_batch
from mmpack_udfs.export import energon
from mmpack_udfs.io import fs
from mmpack_udfs.pack import costs
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.resolve import load_run
from mmpack_udfs.schemas import manifest_uri

WORKERS = 2  # Energon loader workers per rank in the straggling figures


def timed_pack_and_export(demo_out: Path, master: str, repack: bool) -> tuple[dict, Path, Path]:
    """The demo's tokenized table packed again (unless not ``repack``: the smoke run exports the
    demo's own pack), then exported, in one SparkSession: figures of both, the pack's root and
    the export."""
    spark = bench_spark(master)
    root = OUT / "energon-bench"
    shutil.rmtree(root, ignore_errors=True)
    out, pack_s = demo_out, None
    ctx = load_run(demo_out / "input" / "mmpack.yaml", [f"output={out}"])
    if repack:
        out = root / "out"
        shutil.copytree(demo_out / "tables", out / "tables")
        budget = json.loads((demo_out / "packed" / "manifest.json").read_text())["budget"]
        ctx = load_run(demo_out / "input" / "mmpack.yaml", [f"output={out}", f"pack.budget={budget}"])
        started = time.perf_counter()
        pack.run(spark, ctx)
        pack_s = time.perf_counter() - started
    manifest = json.loads((out / "packed" / "manifest.json").read_text())
    started = time.perf_counter()
    exported = energon.run(spark, ctx, str(root / "export"))
    export_s = time.perf_counter() - started
    tar_bytes = sum(t["bytes"] for s in exported["splits"].values() for t in s["tars"])
    bins = manifest["totals"]["bins"]
    figures = {"bins": bins, "export": throughput(export_s, bins, tar_bytes)}
    if pack_s is not None:
        figures["pack"] = throughput(pack_s, bins, manifest["totals"]["bytes"])
    spark.stop()
    return figures, out, root / "export"


def throughput(seconds: float, bins: int, written: int) -> dict:
    return {"seconds": round(seconds, 2), "bins_per_s": round(bins / seconds, 1),
            "mb_per_s": round(written / seconds / 1e6, 2), "bytes": written}  # fmt: skip


def rate(batches) -> dict:
    return timed_tokens(batch["meta"]["num_tokens"] for batch in batches)


def loaders(out: Path, export: Path) -> dict:
    """One epoch in one process: PackedDataset + megatron_batch vs Energon + MmpackTaskEncoder."""
    dataset = PackedDataset(str(out / "packed"), shuffle=False)
    torch_side = rate(megatron_batch(item) for item in dataset)
    energon_side = rate(epoch_loader(export, MmpackTaskEncoder(str(export)), 0, 1, 0))
    return {"PackedDataset + megatron_batch": torch_side, "Energon + MmpackTaskEncoder": energon_side}


def energon_plan(export: Path, index_rows: dict, world: int) -> balance.BalancedPlan:
    """Energon's one-epoch order as a plan: bins[p, r] (cost index rows), fillers at a rank's end."""
    encoder = MmpackTaskEncoder(str(export), with_media=False)
    steps = steps_per_rank(str(export), world, WORKERS)
    columns, fillers = [], []
    for rank in range(world):
        batches = EqualSteps(epoch_loader(export, encoder, rank, world, WORKERS), steps)
        came = [
            (b["meta"]["source"]["shard"], b["meta"]["source"]["row"], b["meta"]["filler"]) for b in batches
        ]
        columns.append([index_rows[shard, row] for shard, row, _ in came])
        fillers.append([filler for *_, filler in came])
    return balance.BalancedPlan(np.array(columns, np.int64).T, np.array(fillers, bool).T)


def straggling(out: Path, export: Path, world_sizes: list[int]) -> list[dict]:
    manifest = json.loads(Path(manifest_uri(str(out))).read_text())
    index = costs.read_index(str(out / "packed"), manifest, fs.LOCAL)
    vision, llm = costs.CostModel.for_profile(manifest["config"], manifest["profile"]).phases(index)
    rows = {
        (int(s), int(r)): i
        for i, (s, r) in enumerate(zip(index["shard"].to_numpy(), index["row"].to_numpy(), strict=True))
    }
    sizes = np.array([u.rows for u in PackedDataset(str(out / "packed")).units], np.int64)
    results = []
    for world in world_sizes:
        plans = {
            "Energon, one epoch (EqualSteps)": energon_plan(export, rows, world),
            "PackedDataset, balance=False": balance.random_plan(sizes, world, 0, 0),
            "PackedDataset, balanced": balance.balanced_plan(vision, llm, sizes, world, 0, 0),
        }
        for name, plan in plans.items():
            overhead = balance.straggler_overhead(vision + llm, plan, 1)
            fillers = int(plan.filler.sum())
            results.append({"world_size": world, "order": name, "steps": plan.positions,
                            "fillers": fillers, "overhead_step": round(overhead, 4)})  # fmt: skip
    return results


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--demo-samples", type=int, default=2000, help="samples of the image demo")
    parser.add_argument("--demo-budget", type=int, help="pack.budget of the image demo (default: the CLI's)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--master", default="local[2]")
    args = parse_with_smoke(
        parser, demo_samples=SMOKE_DEMO_SAMPLES, demo_budget=SMOKE_DEMO_BUDGET, world_sizes=[2]
    )
    demo = ensure_image_demo(args.demo_samples, args.demo_budget).parent
    export_figures, out, export = timed_pack_and_export(demo, args.master, repack=not args.smoke)
    print(json.dumps(export_figures))
    results = {
        "machine": machine(),
        "export": export_figures,
        "loaders": loaders(out, export),
        "straggling": straggling(out, export, args.world_sizes),
    }
    assert load_export(str(export))["splits"]["train"]["bins"] == export_figures["bins"]
    (OUT / "energon.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print("\n| stage | seconds | bins/s | MB/s written |\n| --- | ---: | ---: | ---: |")
    for name in ("pack", "export"):
        if name not in export_figures:
            continue
        f = export_figures[name]
        print(f"| {name} | {f['seconds']} | {f['bins_per_s']} | {f['mb_per_s']} |")
    print("\n| loader (one process) | bins | tokens | tokens/s |\n| --- | ---: | ---: | ---: |")
    for name, f in results["loaders"].items():
        print(f"| {name} | {f['bins']} | {f['tokens']:,} | {f['tokens_per_s']:,} |")
    print("\n| ranks | order | steps | fillers | straggler overhead |\n| ---: | --- | ---: | ---: | ---: |")
    for r in results["straggling"]:
        print(
            f"| {r['world_size']} | {r['order']} | {r['steps']} | {r['fillers']} | {r['overhead_step']:.1%} |"
        )


if __name__ == "__main__":
    main()
