"""Preference pairs as packing units: a pair's two rows (``<id>-chosen``, ``<id>-rejected``,
tokenize) always go into one bin, side by side, so that a DPO step sees whole pairs.

Pure and Spark-free. The pack plans *units* (a row on its own, or a pair's two rows with
their sizes summed) with first-fit-decreasing, then writes each unit's rows in order: a
pair's chosen row immediately followed by its rejected row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmpack_udfs.errors import MmpackError

CHOSEN, REJECTED = "chosen", "rejected"  # schemas.PAIR_SIDES


class PairError(MmpackError, ValueError):
    """The tokenized table holds a pair side without its other side."""


@dataclass(frozen=True)
class Units:
    """The packing units of a counts table sorted by ``sample_id``."""

    first: np.ndarray  # per unit: its row (a pair's chosen row)
    second: np.ndarray  # per unit: a pair's rejected row; -1 for a row on its own

    @property
    def count(self) -> int:
        return len(self.first)

    @property
    def paired(self) -> bool:
        """Whether any unit is a preference pair."""
        return bool((self.second >= 0).any())

    @property
    def width(self) -> int:
        """Rows a unit may hold: 2 when there are pairs."""
        return 2 if self.paired else 1

    def total(self, per_row: np.ndarray) -> np.ndarray:
        """Per unit, the sum of a per-row figure over its rows (int64)."""
        out = per_row[self.first].astype(np.int64)
        pair = self.second >= 0
        out[pair] += per_row[self.second[pair]].astype(np.int64)
        return out

    def unit_of_rows(self) -> np.ndarray:
        """Per row of the counts table, its unit."""
        out = np.empty(self.count + int((self.second >= 0).sum()), np.int64)
        out[self.first] = np.arange(self.count)
        pair = self.second >= 0
        out[self.second[pair]] = np.flatnonzero(pair)
        return out

    def rows(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows of ``units`` (a unit index per item; copies repeat): per row, its item, its
        row of the counts table and its side (0, or 1 for a pair's rejected row), items in
        order and a pair's chosen row first."""
        units = np.asarray(units, np.int64)
        per_item = 1 + (self.second[units] >= 0)
        item = np.repeat(np.arange(len(units)), per_item)
        side = np.arange(len(item)) - np.repeat(np.cumsum(per_item) - per_item, per_item)
        row = np.where(side == 0, self.first[units[item]], self.second[units[item]])
        return item, row, side


def units_of(counts: pa.Table) -> Units:
    """The units of ``counts`` (``sample_id``, ``parent_id``, ``pair_side``; sorted by
    sample_id, so a pair's ``-chosen`` row comes right before its ``-rejected`` row)."""
    n = counts.num_rows
    sides = counts.column("pair_side")
    if sides.null_count == n:  # no pairs: "no second row" is one value, not an array (driver memory)
        return Units(np.arange(n, dtype=np.int64), np.broadcast_to(np.int64(-1), n))
    chosen, rejected = (pc.fill_null(pc.equal(sides, side), False).to_numpy(zero_copy_only=False)
                        for side in (CHOSEN, REJECTED))  # fmt: skip
    partner = np.flatnonzero(chosen) + 1
    parents = counts.column("parent_id")
    whole = (partner < n) & rejected[np.minimum(partner, n - 1)]
    own, next_ = (parents.take(pa.array(rows)) for rows in (partner - 1, partner.clip(max=n - 1)))
    whole &= pc.equal(own, next_).to_numpy(zero_copy_only=False)
    if not whole.all() or rejected.sum() != chosen.sum():
        broken = counts.column("sample_id").take(pa.array(np.flatnonzero(chosen)[~whole][:3])).to_pylist()
        raise PairError(
            f"the tokenized table holds {int(chosen.sum())} chosen and {int(rejected.sum())} rejected rows "
            f"that do not all form pairs (e.g. {', '.join(broken) or 'a rejected row without its chosen'}): "
            "re-run tokenize"
        )
    first = np.flatnonzero(~rejected)
    second = np.where(chosen[first], first + 1, -1)
    return Units(first, second)
