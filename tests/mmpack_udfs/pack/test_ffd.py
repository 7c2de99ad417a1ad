"""First-fit-decreasing: exactness against a naive reference, budgets, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack_udfs.pack.ffd import OversizeError, first_fit_decreasing


def naive_ffd(lengths, budget, keys, second=None, second_budget=None):
    """O(n²) textbook first-fit-decreasing, the reference."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], keys[i]))
    rooms, rooms2, bin_of = [], [], [-1] * len(lengths)
    for i in order:
        need2 = second[i] if second is not None else 0
        for b, room in enumerate(rooms):
            if room >= lengths[i] and (second is None or rooms2[b] >= need2):
                break
        else:
            rooms.append(budget)
            rooms2.append(second_budget or 0)
            b = len(rooms) - 1
        rooms[b] -= lengths[i]
        rooms2[b] -= need2
        bin_of[i] = b
    return bin_of


sizes = st.lists(st.integers(0, 100), min_size=0, max_size=300)


@settings(max_examples=150, deadline=None)
@given(lengths=sizes, budget=st.integers(100, 250), data=st.data())
def test_equals_the_naive_reference(lengths, budget, data):
    keys = data.draw(st.permutations(list(range(len(lengths)))))
    packing = first_fit_decreasing(np.array(lengths), budget, keys=np.array(keys))
    assert packing.bin_of.tolist() == naive_ffd(lengths, budget, keys)


@settings(max_examples=100, deadline=None)
@given(lengths=sizes, budget=st.integers(100, 250), media_budget=st.integers(3, 8), data=st.data())
def test_second_budget_equals_the_naive_reference(lengths, budget, media_budget, data):
    media = data.draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
    keys = list(range(len(lengths)))
    packing = first_fit_decreasing(
        np.array(lengths), budget, keys=np.array(keys), second=np.array(media), second_budget=media_budget
    )
    expected = naive_ffd(lengths, budget, keys, media, media_budget)
    assert packing.bin_of.tolist() == expected
    for b in range(packing.num_bins):
        members = packing.bin_of == b
        assert np.array(lengths)[members].sum() <= budget and np.array(media)[members].sum() <= media_budget


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=2000), seed=st.integers(0, 2**32 - 1))
def test_every_item_in_one_bin_and_order_does_not_matter(lengths, seed):
    lengths = np.array(lengths)
    keys = np.random.default_rng(seed).permutation(len(lengths)).astype(np.uint64) * 7919
    packing = first_fit_decreasing(lengths, 4096, keys=keys)
    assert (packing.bin_of >= 0).all() and packing.num_bins == len(np.unique(packing.bin_of))
    assert np.bincount(packing.bin_of, weights=lengths).max() <= 4096
    assert packing.num_bins >= int(np.ceil(lengths.sum() / 4096))
    shuffle = np.random.default_rng(seed + 1).permutation(len(lengths))
    again = first_fit_decreasing(lengths[shuffle], 4096, keys=keys[shuffle])
    assert (again.bin_of == packing.bin_of[shuffle]).all()


def test_known_small_case_and_bins_listing():
    packing = first_fit_decreasing(np.array([6, 4, 5, 5, 10]), 10)
    assert packing.num_bins == 3
    assert [sorted(b.tolist()) for b in packing.bins()] == [[4], [0, 1], [2, 3]]


def test_oversize_items_error_or_skip():
    with pytest.raises(OversizeError, match="exceed the budget"):
        first_fit_decreasing(np.array([5, 11]), 10)
    packing = first_fit_decreasing(np.array([5, 11, 3]), 10, oversize="skip")
    assert packing.bin_of.tolist() == [0, -1, 0] and packing.skipped.tolist() == [1]
    packing = first_fit_decreasing(
        np.array([5, 1]), 10, second=np.array([1, 9]), second_budget=4, oversize="skip"
    )
    assert packing.bin_of.tolist() == [0, -1]


def test_empty_and_bad_arguments():
    assert first_fit_decreasing(np.array([], np.int64), 10).num_bins == 0
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing(np.array([1]), 0)
    with pytest.raises(ValueError, match="second_budget"):
        first_fit_decreasing(np.array([1]), 5, second=np.array([1]))
    with pytest.raises(ValueError, match="non-negative"):
        first_fit_decreasing(np.array([-1]), 5)
