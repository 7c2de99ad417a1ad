"""The balanced plan as a pure function (no Spark, no torch): exactly once, equal steps,
a new order every epoch, local reads, and less straggling than today's order."""

from __future__ import annotations

import numpy as np
import pytest

from loader import balance, plan
from mmpack_udfs.pack import costs


def stratified_layout(bins: int = 3000, per: int = 32, seed: int = 0):
    """A cost index laid out as pack lays it out: (vision, llm, row group sizes)."""
    rng = np.random.default_rng(seed)
    vision = rng.lognormal(20, 1.0, bins) * (rng.random(bins) < 0.7)
    llm = rng.lognormal(30, 0.2, bins)
    order = costs.stratified_order(costs.order_key(vision, llm), per)
    sizes = [min(per, bins - i) for i in range(0, bins, per)]
    return vision[order], llm[order], np.array(sizes)


VISION, LLM, SIZES = stratified_layout()
UNITS = [plan.Unit(0, i, int(s)) for i, s in enumerate(SIZES)]
STARTS = np.concatenate([[0], np.cumsum(SIZES)[:-1]])


def reader_items(world: int, workers: int, epoch: int = 0, drop_remainder: bool = False):
    """Every reader's items: {(rank, worker): [bin or ('filler', bin)]}."""
    out = {}
    for rank in range(world):
        for worker in range(max(workers, 1)):
            slot = plan.Slot(rank, world, worker, max(workers, 1))
            items = balance.worker_items(VISION, LLM, UNITS, slot, 7, epoch, True, drop_remainder)
            out[rank, worker] = [(i.filler, int(STARTS[i.unit] + i.row)) for i in items]
    return out


@pytest.mark.parametrize("world", range(1, 17))
@pytest.mark.parametrize("workers", range(5))
def test_every_bin_once_and_every_rank_the_same_steps(world, workers):
    items = reader_items(world, workers)
    real = [b for run in items.values() for filler, b in run if not filler]
    assert sorted(real) == list(range(len(VISION)))  # exactly once
    fillers = sum(filler for run in items.values() for filler, _ in run)
    assert fillers == -len(VISION) % world
    per_rank = {r: [len(items[r, w]) for w in range(max(workers, 1))] for r in range(world)}
    assert len({tuple(v) for v in per_rank.values()}) == 1  # same runs per worker: same batches
    assert sum(per_rank[0]) == plan.items_per_rank(len(VISION), world, drop_remainder=False)


@pytest.mark.parametrize("world", [3, 8, 16])
def test_drop_remainder_trains_each_bin_at_most_once_and_no_filler(world):
    items = reader_items(world, 2, drop_remainder=True)
    bins = [b for run in items.values() for filler, b in run]
    assert not any(filler for run in items.values() for filler, _ in run)
    assert len(bins) == len(set(bins)) == len(VISION) // world * world


def test_the_plan_is_a_pure_function_of_seed_and_epoch_and_epochs_differ():
    first = balance.balanced_plan(VISION, LLM, SIZES, 8, seed=3, epoch=0)
    again = balance.balanced_plan(VISION, LLM, SIZES, 8, seed=3, epoch=0)
    second = balance.balanced_plan(VISION, LLM, SIZES, 8, seed=3, epoch=1)
    assert np.array_equal(first.bins, again.bins)
    assert not np.array_equal(first.bins, second.bins)
    steps = {frozenset(row) for row in first.bins.tolist()}
    assert len(steps & {frozenset(row) for row in second.bins.tolist()}) < len(steps) // 2  # new company too


@pytest.mark.parametrize("world", [4, 8])
def test_balanced_steps_straggle_far_less_than_todays_order_and_read_locally(world):
    chosen = balance.balanced_plan(VISION, LLM, SIZES, world, seed=0, epoch=0)
    today = balance.random_plan(SIZES, world, seed=0, epoch=0)
    for cost in (VISION, LLM):
        assert balance.straggler_overhead(cost, chosen, 1) < 0.2 * balance.straggler_overhead(cost, today, 1)
    assert balance.read_amplification(chosen, SIZES) <= 1.25


def test_overhead_and_read_amplification_by_hand():
    chosen = balance.BalancedPlan(np.array([[0, 1], [2, 3]]), np.zeros((2, 2), bool))
    cost = np.array([1.0, 3.0, 2.0, 2.0])
    assert balance.straggler_overhead(cost, chosen, 1) == pytest.approx((3 + 2) / (2 + 2) - 1)
    assert balance.straggler_overhead(cost, chosen, 2) == pytest.approx(5 / 4 - 1)  # one step: 3 vs 5
    assert balance.read_amplification(chosen, np.array([2, 2])) == pytest.approx((4 + 4) / 4)
