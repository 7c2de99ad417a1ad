"""Cost-balanced epochs: which bin every rank trains at every position, so that the slowest
rank is close to the mean in both phases (vision encoder, then LLM).

A *position* is one bin per rank (``R`` bins); a step of ``k`` micro-batches is ``k``
positions, so balancing every position balances every step, whatever ``k``, the batch size
or the number of dataloader workers (each rank maps positions to steps the same way).

Reads stay local: a rank trains whole row groups. The pack job writes row groups
stratified by cost (mmpack_udfs.pack.costs.stratified_order): row group ``i`` holds the
``i``-th bin of every cost stratum of the run, so neighbouring row groups are near-copies.
Each epoch:

1. *Rounds*: full row groups sorted by their mean cost rank (with a seeded jitter of half
   a round, so rounds differ between epochs) are cut into rounds of ``R``.
2. In a round each rank takes one row group; position ``j`` of the round is the ``j``-th
   cheapest bin of every rank's row group.
3. What is left (the partial row group, fewer than ``R`` full ones) is cut into ``R``
   contiguous runs, each sorted by cost and paired by position (with no round at all,
   the bins are instead cut into positions of neighbours in cost); a short position is
   completed with fillers (copies of costly bins, labels masked), or with
   ``drop_remainder`` the odd bins wait for another epoch.
4. Rounds are ordered by the seed and epoch, positions within a round too, and ranks are
   dealt to row groups at random: the epoch's order is new, the plan a pure function of
   (cost index, cost model, seed, epoch, world size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader import plan
from mmpack_udfs.pack import costs
from mmpack_udfs.pack.shards import owner_of_elements

ROUND_JITTER = 0.5  # in rounds: how far a row group may move between rounds, epoch to epoch


@dataclass(frozen=True)
class BalancedPlan:
    """``bins[p, r]``: the bin (row of the cost index) rank ``r`` trains at position ``p``;
    ``filler[p, r]``: that item is a filler (a copy of the bin that trains nothing)."""

    bins: np.ndarray
    filler: np.ndarray

    @property
    def positions(self) -> int:
        return self.bins.shape[0]


def row_groups(unit_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the first bin of each row group, the row group of each bin), bins in index order."""
    starts = np.concatenate([[0], np.cumsum(unit_sizes)[:-1]]).astype(np.int64)
    return starts, owner_of_elements(unit_sizes)


def cost_ranks(key: np.ndarray) -> np.ndarray:
    """Each bin's rank in cost order (ties by index), as a fraction in [0, 1)."""
    ranks = np.empty(len(key), np.float64)
    ranks[np.argsort(key, kind="stable")] = np.arange(len(key))
    return ranks / max(len(key), 1)


def balanced_plan(
    vision: np.ndarray,
    llm: np.ndarray,
    unit_sizes: np.ndarray,
    world_size: int,
    seed: int,
    epoch: int,
    *,
    shuffle: bool = True,
    drop_remainder: bool = False,
) -> BalancedPlan:
    """The epoch's plan. ``vision`` and ``llm`` cost per bin (CostModel.phases), in index
    order; ``unit_sizes``: bins per row group, in the same order."""
    rng = np.random.default_rng([seed, epoch, world_size, 17])
    starts, unit_of_bin = row_groups(unit_sizes)
    rank = cost_ranks(costs.order_key(vision, llm))
    mean_rank = np.bincount(unit_of_bin, weights=rank, minlength=len(unit_sizes)) / np.maximum(unit_sizes, 1)
    per = int(unit_sizes.max()) if len(unit_sizes) else 0
    full = np.flatnonzero(unit_sizes == per)
    full = full[np.argsort(mean_rank[full], kind="stable")]
    if shuffle:  # move each row group by up to half a round: new rounds every epoch
        moved = np.arange(len(full)) + rng.uniform(0, ROUND_JITTER * world_size, len(full))
        full = full[np.argsort(moved, kind="stable")]
    count = len(full) // world_size * world_size
    rounds, left = full[:count].reshape(-1, world_size), full[count:]
    blocks = [_round_block(units, starts, per, rank, rng, shuffle) for units in rounds]
    leftover = np.concatenate([left, np.flatnonzero(unit_sizes != per)])
    leftover = leftover[np.argsort(mean_rank[leftover], kind="stable")]
    if len(leftover):
        bins = np.concatenate([np.arange(starts[u], starts[u] + unit_sizes[u]) for u in leftover])
        blocks.insert(
            int(rng.integers(0, len(blocks) + 1)) if shuffle else len(blocks),
            _leftover_block(
                bins,
                unit_of_bin,
                (rank, vision, llm),
                world_size,
                rng,
                local=len(rounds) > 0,
                shuffle=shuffle,
                drop_remainder=drop_remainder,
            ),
        )
    if shuffle:
        order = rng.permutation(len(blocks))
        blocks = [blocks[i] for i in order]
    if not blocks:
        empty = np.zeros((0, world_size), np.int64)
        return BalancedPlan(empty, empty.astype(bool))
    return BalancedPlan(np.concatenate([b.bins for b in blocks]), np.concatenate([b.filler for b in blocks]))


def _round_block(
    units: np.ndarray, starts: np.ndarray, per: int, rank: np.ndarray, rng: np.random.Generator, shuffle: bool
) -> BalancedPlan:
    """One row group per rank; position j = the j-th cheapest bin of each."""
    if shuffle:
        units = units[rng.permutation(len(units))]
    bins = starts[units][None, :] + np.arange(per)[:, None]  # [per, R]
    bins = np.take_along_axis(bins, np.argsort(rank[bins], axis=0, kind="stable"), axis=0)
    if shuffle:
        bins = bins[rng.permutation(per)]
    return BalancedPlan(bins, np.zeros(bins.shape, bool))


def _leftover_block(
    bins: np.ndarray,
    unit_of_bin: np.ndarray,
    phases: tuple[np.ndarray, np.ndarray, np.ndarray],
    world_size: int,
    rng: np.random.Generator,
    *,
    local: bool,
    shuffle: bool,
    drop_remainder: bool,
) -> BalancedPlan:
    """The bins of the row groups left out of rounds (``bins``: row group after row group).

    Beside rounds, what is left is a few row groups: one contiguous run of them per rank,
    sorted by cost and paired by position, keeps reads local. With no round at all (fewer
    full row groups than ranks: every rank reads more than it trains anyway) the bins are
    sorted by their worse phase rank and cut into positions of neighbours, dealt in row
    group order. A short position is completed with fillers (copies of costly bins), or
    with ``drop_remainder`` the odd bins (random ones) wait for another epoch.
    ``phases``: (cost rank, vision, llm) per bin; ``local``: rounds exist."""
    if drop_remainder:
        odd = len(bins) % world_size
        bins = np.delete(bins, rng.choice(len(bins), odd, replace=False) if shuffle else np.arange(odd))
    rank, vision, llm = phases
    if local:
        cut = _runs_cut(bins, rank, world_size)
    else:
        worse = np.maximum(cost_ranks(vision), cost_ranks(llm))
        cut = _neighbours_cut(bins, unit_of_bin, worse, world_size)
    if shuffle:
        order = rng.permutation(cut.positions)
        cut = BalancedPlan(cut.bins[order], cut.filler[order])
    return cut


def _neighbours_cut(
    bins: np.ndarray, unit_of_bin: np.ndarray, rank: np.ndarray, world_size: int
) -> BalancedPlan:
    bins = bins[np.argsort(rank[bins], kind="stable")]
    positions = -(-len(bins) // world_size)
    short = positions * world_size - len(bins)
    filler = np.zeros((positions, world_size), bool)
    if short:  # copies of the costliest bins
        bins = np.concatenate([bins, bins[::-1][np.arange(short) % len(bins)]])
        filler[-1, world_size - short :] = True
    out = bins.reshape(positions, world_size)
    deal = np.lexsort((unit_of_bin[out], filler), axis=1)  # real bins first, then by row group
    return BalancedPlan(np.take_along_axis(out, deal, axis=1), np.take_along_axis(filler, deal, axis=1))


def _runs_cut(bins: np.ndarray, rank: np.ndarray, world_size: int) -> BalancedPlan:
    base, extra = divmod(len(bins), world_size)
    positions = base + (extra > 0)
    out = np.zeros((positions, world_size), np.int64)
    filler = np.zeros((positions, world_size), bool)
    for r in range(world_size):
        start = r * base + min(r, extra)
        run = bins[start : start + base + (r < extra)]
        run = run[np.argsort(rank[run], kind="stable")]
        if len(run) < positions:  # one short: a copy of its costliest bin (or any, if it has none)
            run = np.append(run, run[-1] if len(run) else bins[r % len(bins)])
            filler[-1, r] = True
        out[:, r] = run
    return BalancedPlan(out, filler)


def worker_items(
    vision: np.ndarray,
    llm: np.ndarray,
    units: list[plan.Unit],
    slot: plan.Slot,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_remainder: bool,
) -> list[plan.Item]:
    """This reader's items in order: its rank's column of the plan, cut into one contiguous
    run per dataloader worker (plan.worker_run), as (row group, row) items."""
    sizes = np.array([u.rows for u in units], np.int64)
    chosen = balanced_plan(
        vision, llm, sizes, slot.world_size, seed, epoch, shuffle=shuffle, drop_remainder=drop_remainder
    )
    first, last = plan.worker_run(chosen.positions, slot.worker, slot.num_workers)
    starts, unit_of_bin = row_groups(sizes)
    bins, fillers = chosen.bins[first:last, slot.rank], chosen.filler[first:last, slot.rank]
    unit_of = unit_of_bin[bins]
    return [
        plan.Item(int(u), int(b - starts[u]), bool(f)) for u, b, f in zip(unit_of, bins, fillers, strict=True)
    ]


# -- measuring a plan ---------------------------------------------------------------------
def random_plan(
    unit_sizes: np.ndarray, world_size: int, seed: int, epoch: int, shuffle_buffer: int = 256
) -> BalancedPlan:
    """Today's order (``balance=False``) as the same matrix: one reader per rank."""
    units = [plan.Unit(0, i, int(size)) for i, size in enumerate(unit_sizes)]
    starts, _ = row_groups(unit_sizes)
    columns, fillers = [], []
    for r in range(world_size):
        slot = plan.Slot(r, world_size)
        items = plan.worker_items(units, slot, seed, epoch, True, False)
        items = plan.shuffled(items, slot, seed, epoch, shuffle_buffer, True)
        columns.append([starts[i.unit] + i.row for i in items])
        fillers.append([i.filler for i in items])
    return BalancedPlan(np.array(columns, np.int64).T, np.array(fillers, bool).T)


def straggler_overhead(cost: np.ndarray, chosen: BalancedPlan, micro_batches: int) -> float:
    """Σ over steps of the slowest rank's cost / Σ of the mean rank's cost − 1. A step is
    ``micro_batches`` positions (a last partial step counts as it is)."""
    per_position = cost[chosen.bins]  # fillers cost what the bin they copy costs
    if not per_position.size:
        return 0.0
    steps = np.add.reduceat(per_position, np.arange(0, chosen.positions, micro_batches), axis=0)
    mean = steps.mean(axis=1).sum()
    return float(steps.max(axis=1).sum() / mean - 1) if mean > 0 else 0.0


def read_amplification(chosen: BalancedPlan, unit_sizes: np.ndarray) -> float:
    """Bins in the row groups each rank reads (each once) / bins trained."""
    _, unit_of_bin = row_groups(unit_sizes)
    used = int((~chosen.filler).sum())
    read = 0
    for r in range(chosen.bins.shape[1]):
        read += int(unit_sizes[np.unique(unit_of_bin[chosen.bins[:, r]])].sum())
    return read / used if used else 1.0


def compare(
    vision: np.ndarray,
    llm: np.ndarray,
    unit_sizes: np.ndarray,
    world_size: int,
    micro_batches: int,
    seed: int = 0,
    epoch: int = 0,
) -> dict[str, dict[str, float | int]]:
    """Straggler overheads per phase and for one sync per step (vision + llm), read
    amplification and steps, of today's order ("random") and the balanced plan."""
    plans = {
        "random": random_plan(unit_sizes, world_size, seed, epoch),
        "balanced": balanced_plan(vision, llm, unit_sizes, world_size, seed, epoch),
    }
    return {
        name: {
            "overhead_step": straggler_overhead(vision + llm, chosen, micro_batches),
            "overhead_vision": straggler_overhead(vision, chosen, micro_batches),
            "overhead_llm": straggler_overhead(llm, chosen, micro_batches),
            "read_amplification": read_amplification(chosen, unit_sizes),
            "steps": -(-chosen.positions // micro_batches),
        }
        for name, chosen in plans.items()
    }
