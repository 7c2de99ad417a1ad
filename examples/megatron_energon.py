"""The data side of a Megatron-Core VLM recipe (Megatron-LM, Megatron-Bridge), on an mmpack
export read by Megatron-Energon:

    .venv/bin/mmpack export energon --out demo-out --to demo-energon
    .venv/bin/python examples/megatron_energon.py demo-energon --dp-size 2 --cp-size 2 --steps 3

``dataloaders(...)`` is what one rank's data provider returns (Megatron-LM's
``train_valid_test_dataloaders_provider``, Bridge's dataset provider): the training loader, an
endless stream of micro-batches (Energon's default: a rank's share, reshuffled every pass) that
Megatron steps ``train_iters`` times on every rank alike, and the validation loader, one epoch
with the same number of micro-batches on every rank (``EqualSteps``). Each micro-batch is one
bin as ``loader.megatron.megatron_batch`` builds it; every context-parallel rank of a
data-parallel rank reads the same bins and keeps its share (``cp_partition``). The loader's
state goes into the checkpoint (``save_state_rank``) and is restored before the first step.

The script walks each (data-parallel, context-parallel) rank through ``--steps`` training
micro-batches, checks that a loader restored from a saved state goes on where it stopped, and
reads the validation epoch: what runs before a GPU is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron.energon import (
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    reraise_exception,
)

from loader.energon import EqualSteps, MmpackTaskEncoder, load_export, steps_per_rank
from loader.megatron import cp_partition, loss_sum_and_tokens

SHUFFLE_BUFFER, SEQUENCE = 100, 100  # Energon's shuffle buffer and samples read in sequence per shard


def worker_config(dp_rank: int, dp_size: int, num_workers: int, group: Any = None) -> WorkerConfig:
    """Energon's view of one data-parallel rank (pass ``group``: the data-parallel process
    group under torch.distributed); a failing bin raises instead of being skipped."""
    return WorkerConfig(
        rank=dp_rank, world_size=dp_size, num_workers=num_workers, data_parallel_group=group,
        global_error_handler=reraise_exception,
    )  # fmt: skip


def dataloaders(
    export: str, dp_rank: int, dp_size: int, num_workers: int, encoder: MmpackTaskEncoder, state: Any = None
) -> tuple[Any, Any]:
    """(training loader, validation loader or None) of one data-parallel rank; ``state``: what
    the training loader's ``save_state_rank`` returned when the checkpoint was written."""
    bins, readers = load_export(export)["splits"]["train"]["bins"], dp_size * max(num_workers, 1)
    if bins < readers:  # Energon cannot repeat a worker's empty share
        raise ValueError(f"{export} has {bins} training bins, fewer than ranks × workers ({readers})")
    config = worker_config(dp_rank, dp_size, num_workers)
    train = get_savable_loader(
        get_train_dataset(
            export,
            worker_config=config,
            task_encoder=encoder,
            batch_size=None,
            shuffle_buffer_size=SHUFFLE_BUFFER,
            max_samples_per_sequence=SEQUENCE,
        )
    )
    if state is not None:
        train.restore_state_rank(state)
    valid = None
    if "val" in load_export(export)["splits"]:
        dataset = get_val_dataset(export, worker_config=config, task_encoder=encoder, batch_size=None)
        valid = EqualSteps(get_savable_loader(dataset), steps_per_rank(export, dp_size, num_workers, "val"))
    return train, valid


def micro_batch_for(batch: dict[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """What one context-parallel rank feeds its model: its share of the bin's tokens; the
    boundaries (``packed_seq_params``) and vision inputs whole."""
    return cp_partition(batch, cp_rank, cp_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("export", help="the folder `mmpack export energon --to` wrote")
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--cp-size", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="Energon loader workers per rank")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    encoder = MmpackTaskEncoder(
        args.export, cp_size=args.cp_size, tp_size=args.tp_size, sequence_parallel=args.sequence_parallel
    )
    for dp_rank in range(args.dp_size):
        train, valid = dataloaders(args.export, dp_rank, args.dp_size, args.workers, encoder)
        batches = iter(train)
        for step in range(args.steps):
            batch = next(batches)
            shares = [micro_batch_for(batch, r, args.cp_size) for r in range(args.cp_size)]
            tokens = sum(loss_sum_and_tokens(s["loss_mask"], s)[1] for s in shares)
            padded, mine = batch["input_ids"].shape[-1], shares[0]["input_ids"].shape[-1]
            print(
                f"dp {dp_rank} step {step}: bin {batch['meta']['key']}, {len(batch['meta']['sample_ids'])} "
                f"samples, {padded} tokens (padded), {mine} per CP rank, {tokens} supervised"
            )
        state = train.save_state_rank()  # into the checkpoint with the model
        expected = next(batches)["meta"]["key"]
        resumed, _ = dataloaders(args.export, dp_rank, args.dp_size, args.workers, encoder, state)
        got = next(iter(resumed))["meta"]["key"]
        verdict = "ok" if got == expected else "WRONG"
        print(f"dp {dp_rank} resume: the restored loader's next bin is {got} ({verdict})")
        if got != expected:
            sys.exit(f"the restored loader gave {got}, the original {expected}")
        if valid is not None:
            fillers = sum(b["meta"]["filler"] for b in valid)
            print(f"dp {dp_rank} validation: {len(valid)} micro-batches ({fillers} fillers)")


if __name__ == "__main__":
    main()
