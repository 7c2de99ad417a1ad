"""Reading plans: pure functions of row counts and seeds (no torch, no files)."""

from __future__ import annotations

import pytest

from loader import plan

SHARDS = [{"rows": 10, "row_groups": 3}, {"rows": 4, "row_groups": 1}, {"rows": 9, "row_groups": 3}]


def all_bins(world: int, workers: int, epoch: int, buffer: int = 5) -> list[list[tuple[int, int, int]]]:
    units = plan.units_of(SHARDS, 4)
    readers = []
    for rank in range(world):
        for worker in range(workers):
            slot = plan.Slot(rank, world, worker, workers)
            mine = plan.worker_units(units, slot, seed=3, epoch=epoch, shuffle=True)
            order = plan.item_order(mine, slot, seed=3, epoch=epoch, buffer_size=buffer, shuffle=True)
            readers.append([(mine[u].shard, mine[u].row_group, row) for u, row in order])
    return readers


def test_units_cover_every_row():
    units = plan.units_of(SHARDS, 4)
    assert [(u.shard, u.row_group, u.rows) for u in units] == [
        (0, 0, 4), (0, 1, 4), (0, 2, 2), (1, 0, 4), (2, 0, 4), (2, 1, 4), (2, 2, 1),
    ]  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("workers", [1, 3])
def test_every_bin_exactly_once_per_epoch(world, workers):
    seen = [b for reader in all_bins(world, workers, epoch=0) for b in reader]
    assert len(seen) == len(set(seen)) == sum(s["rows"] for s in SHARDS)


def test_orders_differ_across_epochs_and_repeat_exactly():
    assert all_bins(2, 1, epoch=0) == all_bins(2, 1, epoch=0)
    assert all_bins(2, 1, epoch=0) != all_bins(2, 1, epoch=1)


def test_no_shuffle_keeps_manifest_order():
    units = plan.units_of(SHARDS, 4)
    slot = plan.Slot()
    order = plan.item_order(plan.worker_units(units, slot, 0, 0, False), slot, 0, 0, 8, False)
    assert order[:5] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]


def test_bad_slot_is_refused():
    with pytest.raises(ValueError, match="bad reader slot"):
        plan.Slot(rank=2, world_size=2)
