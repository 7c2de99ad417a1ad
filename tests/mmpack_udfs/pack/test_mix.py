"""Dataset weights, caps and the evaluation split (pack.mix), without Spark: exact counts,
choices that do not move when data is added, conversations that stay on one side."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from mmpack_udfs.pack import mix
from mmpack_udfs.pack.ffd import first_fit_decreasing


def conversation_ids(first: int, n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(first, first + n)]


def rows(per_dataset: dict[str, list[str]], parts: int = 1) -> pa.Table:
    """Counts-table columns: each conversation as ``parts`` rows (a split conversation)."""
    parents = [p for ids in per_dataset.values() for p in ids for _ in range(parts)]
    datasets = [name for name, ids in per_dataset.items() for _ in ids for _ in range(parts)]
    return pa.table({"parent_id": parents, "dataset": datasets, "num_tokens": np.full(len(parents), 10)})


def settings(*datasets: mix.DatasetMix, fraction: float = 0.0) -> mix.MixSettings:
    return mix.MixSettings(datasets, eval_fraction=fraction, eval_seed=3, seed=5)


def chosen_ids(table: pa.Table, copies: np.ndarray) -> set[str]:
    return set(np.asarray(table["parent_id"].to_pylist())[copies > 0].tolist())


@pytest.mark.parametrize(
    ("weight", "expected"), [(2.0, 200), (0.3, 30), (1.5, 150), (1.0, 100), (0.0, 0), (2.25, 225)]
)
def test_a_weight_gives_exact_copies(weight, expected):
    table = rows({"a": conversation_ids(0, 100)})
    chosen = mix.choose(table, settings(mix.DatasetMix("a", weight)))
    assert chosen.copies.sum() == expected
    assert set(np.unique(chosen.copies)) <= {int(weight), int(weight) + 1}
    assert (chosen.copies > 0).sum() == (100 if weight >= 1 else expected)


def test_max_samples_caps_before_the_weight_and_subsets_are_nested():
    table = rows({"a": conversation_ids(0, 200)})
    capped = mix.choose(table, settings(mix.DatasetMix("a", 2.0, max_samples=50)))
    assert (capped.copies > 0).sum() == 50 and capped.copies.sum() == 100
    smaller = mix.choose(table, settings(mix.DatasetMix("a", 1.0, max_samples=20)))
    assert chosen_ids(table, smaller.copies) < chosen_ids(table, capped.copies)


def test_choices_are_stable_when_data_is_added():
    old = rows({"a": conversation_ids(0, 300)})
    new = rows({"a": conversation_ids(0, 300) + conversation_ids(1000, 100)})
    wanted = settings(mix.DatasetMix("a", 0.3), fraction=0.1)
    before, after = mix.choose(old, wanted), mix.choose(new, wanted)
    assert mix.choose(old, wanted).copies.tolist() == before.copies.tolist()  # a re-run: the same
    # the evaluation side of a conversation never changes when data is added
    assert after.eval[:300].tolist() == before.eval.tolist()
    # the weight's subset: the k smallest hashes, so old choices and new ones are nested
    old_ids, new_ids = (
        chosen_ids(old, before.copies),
        chosen_ids(new, after.copies) & set(old["parent_id"].to_pylist()),
    )
    assert old_ids <= new_ids or new_ids <= old_ids
    assert (after.copies > 0).sum() == round(0.3 * (400 - after.eval.sum()))


def test_eval_samples_and_fraction_hold_out_whole_conversations():
    table = rows({"a": conversation_ids(0, 100), "b": conversation_ids(500, 100)}, parts=3)
    chosen = mix.choose(
        table, settings(mix.DatasetMix("a", eval_samples=7), mix.DatasetMix("b"), fraction=0.2)
    )
    parents = np.asarray(table["parent_id"].to_pylist())
    held = set(parents[chosen.eval])
    assert len(set(parents[:300][chosen.eval[:300]])) == 7
    assert 10 <= len(set(parents[300:][chosen.eval[300:]])) <= 30  # a stable hash below 0.2
    assert not held & set(parents[chosen.copies > 0])  # disjoint by conversation
    assert all(chosen.eval[i] == chosen.eval[i - i % 3] for i in range(len(parents)))  # all parts alike


def test_over_budget_rows_take_no_part_and_the_summary_adds_up():
    table = rows({"a": conversation_ids(0, 50), "b": conversation_ids(100, 50)})
    over = np.array([0, 1, 60])
    chosen = mix.choose(table, settings(mix.DatasetMix("a", 0.5), mix.DatasetMix("b", 2.0)), excluded=over)
    assert chosen.copies[over].sum() == 0 and not chosen.eval[over].any()
    summary = mix.summary(table, chosen, over)
    assert summary["a"]["train_rows"] == 24 and summary["b"]["train_copies"] == 98
    parts = ("train_rows", "eval_rows", "dropped_rows", "over_budget_rows")
    assert sum(d[p] for d in summary.values() for p in parts) == table.num_rows


def test_a_dataset_info_entry_takes_its_config_entry():
    table = rows({"lf/charts": conversation_ids(0, 10)})
    assert mix.choose(table, settings(mix.DatasetMix("lf", 3.0))).copies.sum() == 30


def test_ids_that_are_not_mmpack_sample_ids_are_refused():
    table = pa.table({"parent_id": ["not-a-hash-at-all!"], "dataset": ["a"], "num_tokens": [1]})
    with pytest.raises(mix.MixError, match="SHA-256"):
        mix.choose(table, settings(mix.DatasetMix("a", 0.5)))
    assert mix.choose(table, settings(mix.DatasetMix("a", 2.0))).copies.tolist() == [2]  # no choice to make


def test_copies_of_one_item_go_to_different_bins():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, 300)
    copies = rng.integers(1, 4, 300)
    items = np.repeat(np.arange(300), copies)
    packing = first_fit_decreasing(lengths[items], 1000, groups=items)
    pairs = set(zip(items.tolist(), packing.bin_of.tolist(), strict=True))
    assert len(pairs) == len(items)  # no item has two copies in one bin
    assert np.bincount(packing.bin_of, weights=lengths[items]).max() <= 1000
    assert packing.num_bins <= -(-lengths[items].sum() // 1000) + 2  # fill stays near the bound


@pytest.mark.parametrize("chunk_rows", [1, 3, 1 << 20])
def test_conversations_are_numbered_in_id_order_whatever_the_chunks(chunk_rows):
    """Conversations.of (a sort, compared a chunk at a time) numbers each row's conversation
    as its rank among the distinct ids, in code point order, chunks of ids given in any order."""
    rng = np.random.default_rng(7)
    ids = np.array([*conversation_ids(0, 40), "a", "a-1", "b", "é", "A"], dtype=object)
    parents = ids[rng.integers(0, len(ids), 300)].tolist()
    table = pa.table({"parent_id": pa.chunked_array([parents[:100], parents[100:]], pa.large_string())})
    conversations = mix.Conversations.of(table, chunk_rows=chunk_rows)
    distinct = sorted(set(parents), key=lambda s: s.encode())
    assert conversations.code.tolist() == [distinct.index(p) for p in parents]
    assert conversations.ids(table, np.arange(len(distinct))).to_pylist() == distinct


def test_the_summary_counts_conversations_with_given_or_own_numbering():
    table = rows({"a": conversation_ids(0, 30), "b": conversation_ids(100, 20)}, parts=3)
    chosen = mix.choose(table, settings(mix.DatasetMix("a", 0.5)))
    conversations = mix.Conversations.of(table)
    summary = mix.summary(table, chosen, np.array([], np.int64), conversations)
    assert summary == mix.summary(table, chosen, np.array([], np.int64))
    assert (summary["a"]["samples"], summary["a"]["train_samples"], summary["b"]["samples"]) == (30, 15, 20)
    assert summary["a"]["train_rows"] == 45
