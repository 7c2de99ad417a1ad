"""Which bins a reader yields, in which order: pure functions of the manifest and the seeds.

An epoch is one global stream of bins: the row groups ("units") permuted with
(seed, epoch), each row group's bins in order. Every data-parallel rank takes the same
number of items: a contiguous chunk of the stream (chunks differ by at most one bin), and
a rank whose chunk is one short takes one *filler* (a copy of a real bin whose labels are
all masked), so that every rank runs the same number of steps and no bin counts twice.
With ``drop_remainder`` every rank takes ``bins // world_size`` real bins and the tail of
the stream is left out of that epoch instead.

A rank's items are then cut into contiguous runs, one per dataloader worker, whose sizes
depend only on (items per rank, workers): every rank's workers yield the same counts, so
``DataLoader`` batching gives every rank the same steps. Each worker shuffles its run
through a bounded buffer seeded by (seed, epoch, rank, worker). The whole order is
computed from row counts alone, so resuming means skipping a prefix of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Unit:
    """One Parquet row group: the unit of reading."""

    shard: int  # index into the manifest's shards
    row_group: int
    rows: int


@dataclass(frozen=True)
class Slot:
    """Where this reader sits among all readers."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size and 0 <= self.worker < self.num_workers):
            raise ValueError(f"bad reader slot: {self}")


@dataclass(frozen=True)
class Item:
    """One thing a reader yields: row ``row`` of ``units[unit]``; a filler trains nothing."""

    unit: int
    row: int
    filler: bool = False


def units_of(shards: list[dict], bins_per_row_group: int) -> list[Unit]:
    """Every row group of every shard, in manifest order."""
    units = []
    for index, shard in enumerate(shards):
        for group in range(shard["row_groups"]):
            rows = min(bins_per_row_group, shard["rows"] - group * bins_per_row_group)
            units.append(Unit(index, group, rows))
    return units


def items_per_rank(total_bins: int, world_size: int, drop_remainder: bool) -> int:
    """What every rank yields per epoch (fillers included)."""
    if drop_remainder:
        return total_bins // world_size
    return math.ceil(total_bins / world_size)


def epoch_stream(units: list[Unit], seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """(unit index, row) of every bin in the epoch's global order: units permuted, rows in order."""
    order = np.random.default_rng([seed, epoch]).permutation(len(units)) if shuffle else np.arange(len(units))
    rows = np.array([units[i].rows for i in order], dtype=np.int64)
    starts = np.cumsum(rows) - rows
    unit_of = np.repeat(order, rows)
    return unit_of, np.arange(len(unit_of)) - np.repeat(starts, rows)


def rank_range(total: int, slot: Slot, drop_remainder: bool) -> tuple[int, int, int]:
    """[start, stop) of this rank's real bins in the epoch stream, and its items per epoch
    (stop - start, plus one filler when its chunk is one short)."""
    wanted = items_per_rank(total, slot.world_size, drop_remainder)
    base, extra = divmod(total, slot.world_size)
    start = slot.rank * base + (0 if drop_remainder else min(slot.rank, extra))
    return start, start + min(wanted, base + (slot.rank < extra)), wanted


def worker_run(count: int, worker: int, num_workers: int) -> tuple[int, int]:
    """[start, stop) of a worker's contiguous run among a rank's ``count`` items; the sizes
    depend only on (count, num_workers), so they are the same on every rank."""
    base, extra = divmod(count, num_workers)
    start = worker * base + min(worker, extra)
    return start, start + base + (worker < extra)


def worker_items(
    units: list[Unit], slot: Slot, seed: int, epoch: int, shuffle: bool, drop_remainder: bool
) -> list[Item]:
    """This reader's items, before the buffer shuffle: its run of its rank's items (the rank's
    real bins, then a filler, a copy of a real bin near the rank's chunk, when one short)."""
    unit_of, row_of = epoch_stream(units, seed, epoch, shuffle)
    start, stop, wanted = rank_range(len(unit_of), slot, drop_remainder)
    first, last = worker_run(wanted, slot.worker, slot.num_workers)  # positions in the rank's items
    real = range(start + first, start + min(last, stop - start))
    items = [Item(int(unit_of[i]), int(row_of[i])) for i in real]
    for k in range(max(first, stop - start), last):  # filler positions of this worker's run
        source = (start + k - (stop - start)) % len(unit_of)
        items.append(Item(int(unit_of[source]), int(row_of[source]), filler=True))
    return items


def batches_per_epoch(count: int, num_workers: int, batch_size: int, drop_last: bool = False) -> int:
    """Steps a ``DataLoader(batch_size=…, num_workers=…)`` makes of a rank's ``count`` items:
    each worker batches its own run, so partial batches happen per worker."""
    workers = max(num_workers, 1)  # num_workers=0: the main process is the one reader
    rounding = math.floor if drop_last else math.ceil
    runs = (worker_run(count, w, workers) for w in range(workers))
    return sum(rounding((stop - start) / batch_size) for start, stop in runs)


def shuffled(
    items: list[Item], slot: Slot, seed: int, epoch: int, buffer_size: int, shuffle: bool
) -> list[Item]:
    """The order this reader yields ``items`` in.

    The buffer shuffle: items stream in into a buffer of ``buffer_size``; once it is full,
    each new item replaces a randomly drawn one, which is yielded.
    """
    if not shuffle or buffer_size <= 1:
        return list(items)
    rng = np.random.default_rng([seed, epoch, slot.rank, slot.worker, slot.world_size, slot.num_workers])
    draws = rng.integers(0, buffer_size, size=max(len(items) - buffer_size, 0))
    buffer = list(items[:buffer_size])
    out = []
    for incoming, pick in zip(items[buffer_size:], draws, strict=True):
        out.append(buffer[pick])
        buffer[pick] = incoming
    return out + [buffer[i] for i in rng.permutation(len(buffer))]
