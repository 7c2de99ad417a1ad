"""``python -m loader MANIFEST``: read one epoch and print what the GPU would receive per step."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from torch.utils.data import DataLoader

from loader.collate import collate_packed
from loader.dataset import PackedDataset


def describe_epoch(manifest_uri: str, bins_per_step: int = 1, workers: int = 0, epoch: int = 0) -> int:
    """Print one line per step of one epoch; return the number of steps."""
    dataset = PackedDataset(manifest_uri)
    dataset.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=bins_per_step, collate_fn=collate_packed, num_workers=workers)
    print(f"loader: {manifest_uri}, epoch {epoch}, {len(dataset)} bins, {bins_per_step} bin(s) per step")
    started, steps, tokens = time.perf_counter(), 0, 0
    for steps, batch in enumerate(loader, start=1):
        vision = ""
        for key in ("pixel_values", "pixel_values_videos"):
            if key in batch:
                vision += f", {key} {tuple(batch[key].shape)}"
        supervised = int((batch["labels"] != -100).sum())
        print(
            f"  step {steps:3d}: input_ids {tuple(batch['input_ids'].shape)}, "
            f"{len(batch['cu_seqlens']) - 1} samples (cu_seqlens int32), max_seqlen {batch['max_seqlen']}, "
            f"{supervised} supervised{vision}"
        )
        tokens += batch["num_tokens"]
    seconds = time.perf_counter() - started
    print(f"loader: {steps} steps, {tokens:,} tokens in {seconds:.1f} s")
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    parser.add_argument("manifest", help="manifest.json, its folder, or s3://bucket/prefix")
    parser.add_argument("--bins-per-step", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=0)
    args = parser.parse_args(argv)
    describe_epoch(args.manifest, args.bins_per_step, args.workers, args.epoch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
