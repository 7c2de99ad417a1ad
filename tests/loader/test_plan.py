"""Reading plans: pure functions of row counts and seeds (no torch, no files)."""

from __future__ import annotations

from collections import Counter

import pytest

from loader import plan

SHARDS = [{"rows": 10, "row_groups": 3}, {"rows": 4, "row_groups": 1}, {"rows": 9, "row_groups": 3}]
TOTAL = sum(s["rows"] for s in SHARDS)  # 23 bins: divides by no world size but 1 and 23


def reader_items(
    world: int, workers: int, epoch: int = 0, buffer: int = 5, drop_remainder: bool = False, shards=SHARDS
) -> dict[tuple[int, int], list[tuple[int, int, int, bool]]]:
    """(rank, worker) → the (shard, row group, row, filler) it yields, in order.
    ``workers=0`` is the DataLoader's main process: one reader per rank."""
    units = plan.units_of(shards, 4)
    readers = {}
    for rank in range(world):
        for worker in range(max(workers, 1)):
            slot = plan.Slot(rank, world, worker, max(workers, 1))
            mine = plan.worker_items(units, slot, 3, epoch, shuffle=True, drop_remainder=drop_remainder)
            order = plan.shuffled(mine, slot, seed=3, epoch=epoch, buffer_size=buffer, shuffle=True)
            readers[rank, worker] = [
                (units[i.unit].shard, units[i.unit].row_group, i.row, i.filler) for i in order
            ]
    return readers


def test_units_cover_every_row():
    units = plan.units_of(SHARDS, 4)
    assert [(u.shard, u.row_group, u.rows) for u in units] == [
        (0, 0, 4), (0, 1, 4), (0, 2, 2), (1, 0, 4), (2, 0, 4), (2, 1, 4), (2, 2, 1),
    ]  # fmt: skip


@pytest.mark.parametrize("world", range(1, 17))
@pytest.mark.parametrize("workers", range(5))
def test_equal_steps_and_every_bin_trained_exactly_once(world, workers):
    readers = reader_items(world, workers)
    per_rank = Counter()
    for (rank, _), items in readers.items():
        per_rank[rank] += len(items)
    assert set(per_rank.values()) == {plan.items_per_rank(TOTAL, world, False)}
    # every rank's workers yield the same counts, so batching gives every rank the same steps
    for worker in range(max(workers, 1)):
        assert len({len(readers[rank, worker]) for rank in range(world)}) == 1
    real = [item[:3] for items in readers.values() for item in items if not item[3]]
    assert len(real) == len(set(real)) == TOTAL
    fillers = [item for items in readers.values() for item in items if item[3]]
    assert len(fillers) == world * plan.items_per_rank(TOTAL, world, False) - TOTAL < world
    for batch_size in (1, 2, 3):
        steps = [
            sum(-(-len(readers[rank, w]) // batch_size) for w in range(max(workers, 1)))
            for rank in range(world)
        ]
        expected = plan.batches_per_epoch(plan.items_per_rank(TOTAL, world, False), workers, batch_size)
        assert steps == [expected] * world


@pytest.mark.parametrize("world", [1, 2, 5, 16, 30])
def test_drop_remainder_trains_equal_real_bins_and_no_filler(world):
    readers = reader_items(world, 2, drop_remainder=True)
    per_rank = Counter()
    for (rank, _), items in readers.items():
        per_rank[rank] += len(items)
        assert not any(item[3] for item in items)
    assert set(per_rank.values()) == {TOTAL // world}
    real = [item[:3] for items in readers.values() for item in items]
    assert len(real) == len(set(real)) == (TOTAL // world) * world


def test_more_ranks_than_bins_and_no_bins():
    readers = reader_items(30, 1)
    assert {len(items) for items in readers.values()} == {1}
    assert sum(not items[0][3] for items in readers.values()) == TOTAL
    empty = reader_items(3, 2, shards=[{"rows": 0, "row_groups": 0}])
    assert all(items == [] for items in empty.values())


def test_batches_per_epoch_counts_partial_batches_per_worker():
    # 7 items over 2 workers: runs of 4 and 3; batches of 2 → 2 + 2
    assert plan.batches_per_epoch(7, num_workers=2, batch_size=2) == 4
    assert plan.batches_per_epoch(7, num_workers=2, batch_size=2, drop_last=True) == 3
    assert plan.batches_per_epoch(7, num_workers=0, batch_size=2) == 4


def test_orders_differ_across_epochs_and_repeat_exactly():
    assert reader_items(2, 1, epoch=0) == reader_items(2, 1, epoch=0)
    assert reader_items(2, 1, epoch=0) != reader_items(2, 1, epoch=1)


def test_no_shuffle_keeps_manifest_order():
    units = plan.units_of(SHARDS, 4)
    slot = plan.Slot()
    items = plan.worker_items(units, slot, 0, 0, shuffle=False, drop_remainder=False)
    order = plan.shuffled(items, slot, 0, 0, 8, shuffle=False)
    assert [(i.unit, i.row) for i in order[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]


def test_bad_slot_is_refused():
    with pytest.raises(ValueError, match="bad reader slot"):
        plan.Slot(rank=2, world_size=2)
