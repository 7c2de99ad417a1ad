"""``python -m loader MANIFEST``: read one epoch and print what the GPU would receive per step."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from torch.utils.data import DataLoader

from loader.collate import collate_packed
from loader.dataset import PackedDataset


def describe_epoch(
    manifest_uri: str,
    bins_per_step: int = 1,
    workers: int = 0,
    epoch: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    show_steps: int | None = None,
) -> int:
    """Read one epoch; print one line per step (the first ``show_steps`` only, when given)
    and a summary; return the number of steps."""
    dataset = PackedDataset(manifest_uri, rank=rank, world_size=world_size)
    dataset.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=bins_per_step, collate_fn=collate_packed, num_workers=workers)
    print(
        f"loader: {manifest_uri}, epoch {epoch}, {len(dataset)} bins on this rank, "
        f"{bins_per_step} bin(s) per step, {dataset.num_batches(bins_per_step, workers)} steps"
    )
    started, steps, tokens = time.perf_counter(), 0, 0
    for steps, batch in enumerate(loader, start=1):
        vision = ""
        for key in ("pixel_values", "pixel_values_videos"):
            if key in batch:
                vision += f", {key} {tuple(batch[key].shape)}"
        meta = batch.meta
        filler = f", {meta['fillers']} filler bin(s)" if meta["fillers"] else ""
        tokens += meta["num_tokens"]
        if show_steps is not None and steps > show_steps:
            continue
        print(
            f"  step {steps:3d}: input_ids {tuple(batch['input_ids'].shape)}, "
            f"position_ids {tuple(batch['position_ids'].shape)}, {len(meta['sample_ids'])} samples, "
            f"max_length {meta['max_length']}, {meta['supervised_tokens']} supervised{vision}{filler}"
        )
    if show_steps is not None and steps > show_steps:
        print(f"  ... {steps - show_steps} more steps")
    seconds = time.perf_counter() - started
    print(f"loader: {steps} steps, {tokens:,} tokens in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s)")
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    parser.add_argument("manifest", help="manifest.json, its folder, or s3://bucket/prefix")
    parser.add_argument("--bins-per-step", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--rank", type=int, default=None, help="read as this data-parallel rank")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--show-steps", type=int, default=None, help="print only the first N steps")
    args = parser.parse_args(argv)
    describe_epoch(
        args.manifest,
        args.bins_per_step,
        args.workers,
        args.epoch,
        args.rank,
        args.world_size,
        show_steps=args.show_steps,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
