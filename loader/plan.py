"""Which bins a reader yields, in which order: pure functions of the manifest and the seeds.

An epoch's work is a list of row groups ("units"). They are permuted with
(seed, epoch), dealt to data-parallel ranks, then to dataloader workers, so that every
bin is read exactly once per epoch. Each worker then shuffles its bins through a bounded
buffer seeded by (seed, epoch, rank, worker). The whole order is computed from row
counts alone, so resuming means skipping a prefix of it without reading anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Unit:
    """One Parquet row group: the unit of reading and of splitting work."""

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


def units_of(shards: list[dict], bins_per_row_group: int) -> list[Unit]:
    """Every row group of every shard, in manifest order."""
    units = []
    for index, shard in enumerate(shards):
        for group in range(shard["row_groups"]):
            rows = min(bins_per_row_group, shard["rows"] - group * bins_per_row_group)
            units.append(Unit(index, group, rows))
    return units


def worker_units(units: list[Unit], slot: Slot, seed: int, epoch: int, shuffle: bool) -> list[Unit]:
    """This reader's row groups for the epoch: permuted, dealt to ranks, then to workers."""
    order = np.random.default_rng([seed, epoch]).permutation(len(units)) if shuffle else np.arange(len(units))
    mine = order[slot.rank :: slot.world_size][slot.worker :: slot.num_workers]
    return [units[i] for i in mine]


def item_order(
    units: list[Unit], slot: Slot, seed: int, epoch: int, buffer_size: int, shuffle: bool
) -> list[tuple[int, int]]:
    """(unit position in ``units``, row) pairs in the order this reader yields them.

    The buffer shuffle: bins stream in unit order into a buffer of ``buffer_size``; once it
    is full, each new bin replaces a randomly drawn one, which is yielded.
    """
    stream = [(u, row) for u, unit in enumerate(units) for row in range(unit.rows)]
    if not shuffle or buffer_size <= 1:
        return stream
    rng = np.random.default_rng([seed, epoch, slot.rank, slot.worker, slot.world_size, slot.num_workers])
    draws = rng.integers(0, buffer_size, size=max(len(stream) - buffer_size, 0))
    buffer = stream[:buffer_size]
    out = []
    for incoming, pick in zip(stream[buffer_size:], draws, strict=True):
        out.append(buffer[pick])
        buffer[pick] = incoming
    return out + [buffer[i] for i in rng.permutation(len(buffer))]
