"""Preference pairs as packing units, without Spark: a pair's two rows always share a bin, side
by side (chosen first), copies of a pair go to different bins, and a pair over the budget is
left out whole. Validate names a bin whose pair is broken."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mmpack_udfs.config import load_config
from mmpack_udfs.pack import pairs, shards
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.validate.stage import bin_problems
from tests.mmpack_udfs.pack.test_shards import tokenized_rows

SETTINGS = pack.PackSettings.from_config(
    load_config(None, ["pack.budget=900", "pack.bins_per_shard=8", "pack.bins_per_row_group=4",
                       "pack.embed_media=false", "pack.oversize=skip"])
)  # fmt: skip


def pair_rows(pairs_: int = 60, singles: int = 0, seed: int = 3) -> pa.Table:
    """Tokenized-like rows: ``pairs_`` pairs (rows ``p<k>-chosen``, ``p<k>-rejected``), then
    ``singles`` rows of their own; sorted by sample_id as the pack reads them."""
    rows = tokenized_rows(2 * pairs_ + singles, seed=seed)
    ids, parents, sides = [], [], []
    for k in range(pairs_):
        for side in ("chosen", "rejected"):
            ids.append(f"p{k:04d}-{side}")
            parents.append(f"p{k:04d}")
            sides.append(side)
    ids += [f"s{k:04d}" for k in range(singles)]
    parents += ids[2 * pairs_ :]
    sides += [None] * singles
    rows = rows.set_column(0, "sample_id", pa.array(ids))
    rows = rows.set_column(
        rows.schema.get_field_index("pair_side"), "pair_side", pa.array(sides, pa.string())
    )
    rows = rows.set_column(
        rows.schema.get_field_index("dataset"), "dataset", pa.array(["prefs"] * rows.num_rows)
    )
    rows = rows.append_column("parent_id", pa.array(parents))
    return rows.take(pc.sort_indices(rows, [("sample_id", "ascending")]))


def bins_of(placement: pack.Placement) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """(shard, bin row) → its (position, sample id) in position order."""
    out: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for sid, shard, row, position in zip(
        placement.sample_id.to_pylist(), placement.shard, placement.bin_row, placement.position, strict=True
    ):
        out.setdefault((int(shard), int(row)), []).append((int(position), sid))
    return {k: sorted(v) for k, v in out.items()}


def test_units_pair_the_chosen_row_with_the_next_rejected_row():
    rows = pair_rows(pairs_=3, singles=2)
    units = pairs.units_of(rows)
    assert units.count == 5 and units.paired
    ids = rows.column("sample_id").to_pylist()
    assert [(ids[f], ids[s] if s >= 0 else None) for f, s in zip(units.first, units.second, strict=True)] == [
        ("p0000-chosen", "p0000-rejected"), ("p0001-chosen", "p0001-rejected"),
        ("p0002-chosen", "p0002-rejected"), ("s0000", None), ("s0001", None),
    ]  # fmt: skip
    lengths = rows.column("num_tokens").to_numpy()
    assert units.total(lengths)[0] == lengths[0] + lengths[1]
    assert (units.unit_of_rows() == [0, 0, 1, 1, 2, 2, 3, 4]).all()


def test_a_side_without_its_other_side_is_refused():
    rows = pair_rows(pairs_=3)
    with pytest.raises(pairs.PairError, match="do not all form pairs"):
        pairs.units_of(rows.filter(pc.not_equal(rows["sample_id"], "p0001-rejected")))


def test_every_pair_is_side_by_side_in_one_bin_chosen_first():
    rows = pair_rows(pairs_=80, singles=30)
    placement = pack.place(rows, SETTINGS)
    assert placement.items == rows.num_rows
    lengths = dict(
        zip(rows.column("sample_id").to_pylist(), rows.column("num_tokens").to_pylist(), strict=True)
    )
    for members in bins_of(placement).values():
        ids = [sid for _, sid in members]
        assert sum(lengths[s] for s in ids) <= SETTINGS.budget
        for i, sid in enumerate(ids):
            if sid.endswith("-chosen"):
                assert ids[i + 1] == sid.replace("-chosen", "-rejected")
            elif sid.endswith("-rejected"):
                assert ids[i - 1] == sid.replace("-rejected", "-chosen")


def test_copies_of_a_pair_go_to_different_bins_and_an_oversized_pair_is_left_out_whole():
    rows = pair_rows(pairs_=40)
    lengths = rows.column("num_tokens").to_numpy()
    over = pack.check_oversize(rows, pack.PackSettings.from_config(
        load_config(None, ["pack.budget=300", "pack.oversize=skip"])))  # fmt: skip
    pair_total = lengths[0::2] + lengths[1::2]
    assert sorted(over.tolist()) == sorted(
        [2 * k for k in np.flatnonzero(pair_total > 300)]
        + [2 * k + 1 for k in np.flatnonzero(pair_total > 300)]
    )  # both rows of a pair, and only when the pair is over, not one row
    copies = np.full(rows.num_rows, 2)
    placement = pack.place(rows, SETTINGS, copies)
    found = bins_of(placement)
    assert placement.items == 2 * rows.num_rows
    homes: dict[str, list] = {}
    for where, members in found.items():
        for _, sid in members:
            homes.setdefault(sid, []).append(where)
    assert all(len(set(h)) == 2 for h in homes.values())  # two copies, two bins
    for sid, where in homes.items():  # and each copy next to its other side
        other = (
            sid.replace("-chosen", "-rejected")
            if sid.endswith("-chosen")
            else sid.replace("-rejected", "-chosen")
        )
        assert sorted(where) == sorted(homes[other])


def placed_bins(rows: pa.Table) -> pa.Table:
    """The bins of ``rows`` as the shard tasks build them from the placement."""
    placement = pack.place(rows, SETTINGS)
    index = {sid: i for i, sid in enumerate(rows.column("sample_id").to_pylist())}
    placed = rows.take(pa.array([index[sid] for sid in placement.sample_id.to_pylist()]))
    for name in ("shard", "bin_row", "position"):
        placed = placed.append_column(name, pa.array(getattr(placement, name).astype(np.int32)))
    placed = placed.filter(pc.equal(placed["shard"], 0))
    placed = placed.take(pc.sort_indices(placed, [("bin_row", "ascending"), ("position", "ascending")]))
    per_bin = np.bincount(placed.column("bin_row").to_numpy())
    lay = shards.BinLayout(
        rows=np.arange(placed.num_rows), bin_starts=np.concatenate([[0], np.cumsum(per_bin)])
    )
    return pa.Table.from_batches([shards.build_bins(placed, lay, 0, lay.num_bins, group=0, read_media=None)])


def test_validate_names_a_bin_whose_pair_is_not_side_by_side():
    bins = placed_bins(pair_rows(pairs_=50, singles=10))
    assert bins["sample_pair_sides"].to_pylist()[0][:2] in (
        ["chosen", "rejected"],
        [None, "chosen"],
        [None, None],
    )
    assert bin_problems(bins, SETTINGS.budget) == []
    row = next(i for i, sides in enumerate(bins["sample_pair_sides"].to_pylist()) if "chosen" in sides)
    ids = bins["sample_ids"].to_pylist()
    swapped = list(reversed(ids[row]))  # rejected before chosen
    broken = bins.set_column(
        bins.schema.get_field_index("sample_ids"),
        "sample_ids",
        pa.array([*ids[:row], swapped, *ids[row + 1 :]]),
    )
    sides = bins["sample_pair_sides"].to_pylist()
    broken = broken.set_column(
        broken.schema.get_field_index("sample_pair_sides"),
        "sample_pair_sides",
        pa.array([*sides[:row], sides[row][::-1], *sides[row + 1 :]], pa.list_(pa.string())),
    )
    problems = bin_problems(broken, SETTINGS.budget)
    assert any("a preference pair not side by side" in p and f"rows {row}" in p for p in problems), problems
