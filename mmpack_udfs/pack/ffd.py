"""First-fit-decreasing bin packing: pure, Spark-free, O(n log n), deterministic.

Items are sorted by decreasing length, ties broken by a caller-given stable key (never by
input order), then each goes into the first bin with room. "First bin with room" is a
descent in a max segment tree over the bins' remaining room: bins not opened yet have
the whole budget, so the leftmost fit opens a new bin exactly when no open bin fits.

An optional second size per item (media items, vision patches) with its own budget is
honoured by descending two trees at once; a subtree is skipped when either maximum is
too small, so the search stays near-logarithmic in practice.

Optional ``groups``: items of one group (copies of one sample, from a dataset weight) go
into different bins. They are equal in length and key, so they come one after the other;
while one is placed, the bins its earlier copies took are hidden from the search.

The hot loop is compiled with numba; no Python runs per item.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

OVERSIZE_POLICIES = ("error", "skip")


class OversizeError(ValueError):
    """An item is larger than a budget and the policy is ``error``."""


@dataclass(frozen=True)
class Packing:
    bin_of: np.ndarray  # int64 per item: its bin, or -1 for a skipped oversize item
    num_bins: int
    skipped: np.ndarray  # indices of items skipped as oversize

    def bins(self) -> list[np.ndarray]:
        """Item indices per bin, in packing order (longest first)."""
        order = np.argsort(self.bin_of, kind="stable")
        order = order[self.bin_of[order] >= 0]
        cuts = np.flatnonzero(np.diff(self.bin_of[order])) + 1
        return np.split(order, cuts) if len(order) else []


def first_fit_decreasing(
    lengths: np.ndarray,
    budget: int,
    *,
    keys: np.ndarray | None = None,
    second: np.ndarray | None = None,
    second_budget: int | None = None,
    oversize: str = "error",
    groups: np.ndarray | None = None,
) -> Packing:
    """Pack items of ``lengths`` (and ``second`` sizes) into bins of ``budget`` (``second_budget``).

    ``keys`` (uint64/int64, one per item, e.g. a hash of the sample id) break ties between
    equal lengths so that the result does not depend on the order items arrive in.
    ``groups`` (int64, one per item): items sharing a group never share a bin; they must be
    equal in length and key (copies of one item).
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    n = len(lengths)
    if oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"oversize must be one of {OVERSIZE_POLICIES}, got {oversize!r}")
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    if (second is None) != (second_budget is None):
        raise ValueError("give both second and second_budget, or neither")
    use_second = second is not None
    second = np.ascontiguousarray(second, dtype=np.int64) if use_second else np.zeros(0, np.int64)
    second_budget = int(second_budget) if second_budget is not None else 0
    if (
        (use_second and len(second) != n)
        or (keys is not None and len(keys) != n)
        or (groups is not None and len(groups) != n)
    ):
        raise ValueError("lengths, second, keys and groups must have one entry per item")
    if (lengths < 0).any() or (second < 0).any():
        raise ValueError("sizes must be non-negative")

    too_big = lengths > budget
    if use_second and second_budget:
        too_big |= second > second_budget
    if too_big.any() and oversize == "error":
        first = int(np.flatnonzero(too_big)[0])
        raise OversizeError(
            f"{int(too_big.sum())} item(s) exceed the budget, e.g. item {first}: length "
            f"{lengths[first]} > {budget}"
            + (f" or second size {second[first]} > {second_budget}" if second_budget else "")
        )
    # longest first; equal lengths by key, or in item order (a stable sort)
    order = np.argsort(-lengths, kind="stable") if keys is None else np.lexsort((np.asarray(keys), -lengths))
    if too_big.any():
        order = order[~too_big[order]]
    bin_of = np.full(n, -1, np.int64)
    group_of = np.arange(n, dtype=np.int64) if groups is None else np.ascontiguousarray(groups, np.int64)
    widest = _widest_group(group_of)
    num_bins = _pack(lengths, second, order, budget, second_budget, group_of, widest, bin_of)
    return Packing(bin_of=bin_of, num_bins=int(num_bins), skipped=np.flatnonzero(too_big))


def _widest_group(group_of: np.ndarray) -> int:
    """The most items any one group holds (1 without items)."""
    if not len(group_of):
        return 1
    if group_of.min() >= 0:  # group numbers, as the pack stage gives them: count without sorting
        return int(np.bincount(group_of).max())
    return int(np.unique(group_of, return_counts=True)[1].max())


@numba.njit(cache=True)
def _pack(lengths, second, order, budget, second_budget, group_of, widest, bin_of):  # pragma: no cover
    n = len(order)
    size = 1
    while size < max(n, 1):
        size *= 2
    room = np.full(2 * size, budget, np.int64)
    use_second = second_budget > 0
    room2 = np.full(2 * size if use_second else 2, second_budget, np.int64)
    num_bins = 0
    stack = np.empty(128, np.int64)
    taken = np.empty(widest, np.int64)  # leaves of the bins the current group's items took
    saved = np.empty((widest, 2), np.int64)  # their room while hidden
    num_taken, group = 0, -1
    for item in order:
        need = lengths[item]
        need2 = second[item] if use_second else 0
        if group_of[item] != group:
            group, num_taken = group_of[item], 0
        for k in range(num_taken):  # hide them from the search
            saved[k, 0], saved[k, 1] = room[taken[k]], room2[taken[k]] if use_second else 0
            _set_leaf(room, taken[k], -1)
            if use_second:
                _set_leaf(room2, taken[k], -1)
        # leftmost leaf with room >= need (and room2 >= need2): DFS with pruning
        leaf = -1
        stack[0] = 1
        top = 1
        while top > 0:
            top -= 1
            node = stack[top]
            if room[node] < need or (use_second and room2[node] < need2):
                continue
            if node >= size:
                leaf = node
                break
            stack[top] = 2 * node + 1  # right child visited after the left one
            stack[top + 1] = 2 * node
            top += 2
        for k in range(num_taken):  # and show them again
            _set_leaf(room, taken[k], saved[k, 0])
            if use_second:
                _set_leaf(room2, taken[k], saved[k, 1])
        taken[num_taken] = leaf
        num_taken += 1
        b = leaf - size
        bin_of[item] = b
        if b + 1 > num_bins:
            num_bins = b + 1
        _set_leaf(room, leaf, room[leaf] - need)
        if use_second:
            _set_leaf(room2, leaf, room2[leaf] - need2)
    return num_bins


@numba.njit(cache=True)
def _set_leaf(tree, leaf, value):  # pragma: no cover - compiled
    """Set a leaf of a max segment tree and update its ancestors."""
    tree[leaf] = value
    node = leaf // 2
    while node >= 1:
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
        node //= 2
