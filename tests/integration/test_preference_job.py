"""Preference pairs through the whole pipeline on real Spark: LLaMA-Factory ranking, TRL and
OpenAI preference files with images → pairs in the samples table (malformed pairs
quarantined with their reasons) → two tokenized rows per pair → both sides side by side in
one bin (validate checks it and names a hand-broken shard) → every pair exactly once per
epoch across ranks → per-pair log-probabilities from one packed forward equal each
sequence's alone."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from loader import PackedDataset, collate_packed
from mmpack_udfs.context import RunContext
from mmpack_udfs.io import fs, tables
from mmpack_udfs.reasons import PREFERENCE_REASONS
from mmpack_udfs.validate import stage as validate

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def run(preference_run) -> tuple[Path, RunContext, dict]:
    return preference_run.output, preference_run.ctx, preference_run.summaries


def table(out: Path, name: str, columns: list[str]) -> pa.Table:
    return tables.read_arrow(str(out / "tables" / name), fs.LOCAL, columns=columns)


def bins(root: Path) -> list[dict]:
    """Every bin of a pack: its sample ids and pair sides."""
    manifest = json.loads((root / "manifest.json").read_text())
    out = []
    for shard in manifest["shards"]:
        out += pq.read_table(root / shard["path"], columns=["sample_ids", "sample_pair_sides"]).to_pylist()
    return out


def test_every_form_is_read_as_pairs_and_malformed_pairs_are_quarantined(run, preference_demo):
    out, _, summaries = run
    samples = table(out, "samples", ["sample_id", "dataset", "rejected", "media"])
    assert samples.num_rows > 0 and samples["rejected"].null_count == 0  # every sample is a pair
    datasets = Counter(samples["dataset"].to_pylist())
    assert len(datasets) == 3 and min(datasets.values()) > 0, datasets  # LLaMA-Factory, TRL, OpenAI
    assert sum(len(m) for m in samples["media"].to_pylist()) > 0  # with images
    reasons = Counter(table(out, "quarantine", ["reason"])["reason"].to_pylist())
    assert {str(r) for r in PREFERENCE_REASONS} <= set(reasons), reasons
    t = summaries["normalize"]["totals"]
    assert t["read"] == t["samples"] + t["duplicates"] + t["quarantined"] == preference_demo.records


def test_a_pair_is_two_tokenized_rows_supervised_on_their_answers(run):
    out, _, summaries = run
    rows = table(out, "tokenized", ["sample_id", "parent_id", "pair_side", "supervised_tokens", "media"])
    sides = Counter(zip(rows["parent_id"].to_pylist(), rows["pair_side"].to_pylist(), strict=True))
    parents = set(rows["parent_id"].to_pylist())
    assert len(sides) == rows.num_rows == 2 * len(parents)  # one chosen and one rejected row each
    assert summaries["tokenize"]["counts"]["tokenized_samples"] == len(parents)
    by_id = {r["sample_id"]: r for r in rows.to_pylist()}
    for parent in parents:
        chosen, rejected = by_id[f"{parent}-chosen"], by_id[f"{parent}-rejected"]
        assert chosen["supervised_tokens"] > 0 and rejected["supervised_tokens"] > 0
        assert [m["uri"] for m in chosen["media"]] == [m["uri"] for m in rejected["media"]]


def test_both_sides_of_every_pair_are_side_by_side_in_one_bin(run):
    out, _, _ = run
    manifest = json.loads((out / "packed/manifest.json").read_text())
    assert manifest["preference"] is True
    seen = Counter()
    for b in bins(out / "packed"):
        ids, sides = b["sample_ids"], b["sample_pair_sides"]
        assert sides == ["chosen", "rejected"] * (len(ids) // 2)
        for chosen, rejected in zip(ids[0::2], ids[1::2], strict=True):
            assert chosen.removesuffix("-chosen") == rejected.removesuffix("-rejected")
            seen[chosen.removesuffix("-chosen")] += 1
    rows = table(out, "tokenized", ["parent_id"])
    skipped = {s["sample_id"] for s in json.loads((out / "report/pack_skipped.json").read_text())}
    assert set(seen) | {s.rsplit("-", 1)[0] for s in skipped} == set(rows["parent_id"].to_pylist())
    assert set(seen.values()) == {1}


def test_the_pack_validates_and_a_hand_broken_pair_fails(spark, run, tmp_path):
    import shutil

    out, ctx, _ = run
    assert validate.run(spark, ctx)["ok"]
    broken = tmp_path / "out"
    shutil.copytree(out, broken)
    manifest_path = broken / "packed/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["shards"][0]
    path = broken / "packed" / entry["path"]
    shard = pq.read_table(path)
    rows = shard.to_pylist()
    row = next(i for i, r in enumerate(rows) if len(r["sample_ids"]) >= 2)
    rows[row]["sample_pair_sides"] = rows[row]["sample_pair_sides"][::-1]  # rejected named first
    pq.write_table(pa.Table.from_pylist(rows, schema=shard.schema), path, compression="zstd")
    data = path.read_bytes()
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))
    problems, _ = validate.check_shard(str(broken / "packed"), entry, manifest["budget"], fs.LOCAL)
    assert any("a preference pair not side by side" in p for p in problems), problems


@pytest.mark.parametrize(("world", "workers"), [(2, 0), (2, 2), (3, 1)])
def test_every_pair_is_read_exactly_once_per_epoch_across_ranks(run, world, workers):
    out, _, _ = run
    expected = Counter()
    for b in bins(out / "packed"):
        expected.update(zip(b["sample_ids"][0::2], b["sample_ids"][1::2], strict=True))
    seen, steps = Counter(), []
    for rank in range(world):
        data = PackedDataset(str(out / "packed"), rank=rank, world_size=world, with_media=False)
        assert data.preference
        batches = list(DataLoader(data, batch_size=2, num_workers=workers, collate_fn=collate_packed))
        steps.append(len(batches))
        for batch in batches:
            ids = batch.meta["sample_ids"]
            seen.update((ids[c], ids[r]) for c, r in batch.meta["pairs"])
    assert seen == expected and len(set(steps)) == 1


def test_weights_and_the_eval_split_move_whole_pairs_and_validate(spark, preference_run, tmp_path):
    """Packed again with a weight of 2 on one dataset and an evaluation split: a pair's copies
    go to different bins, each next to its other side; held-out pairs are whole; validate
    recomputes the mix and finds every row where it belongs."""
    import shutil

    from mmpack_udfs.config.loading import checked
    from mmpack_udfs.pack import stage as pack

    out = tmp_path / "out"
    shutil.copytree(preference_run.output / "tables", out / "tables")
    config = preference_run.ctx.config.as_dict()
    datasets = [{**d, "weight": 2.0} if d["name"] == "trl" else d for d in config["datasets"]]
    ctx = preference_run.ctx.with_config(
        checked({**config, "datasets": datasets, "output": str(out), "eval": {"fraction": 0.25}})
    )
    pack.run(spark, ctx)
    homes: dict[str, list[int]] = {}
    for number, b in enumerate(bins(out / "packed")):
        assert b["sample_pair_sides"] == ["chosen", "rejected"] * (len(b["sample_ids"]) // 2)
        for chosen in b["sample_ids"][0::2]:
            homes.setdefault(chosen.removesuffix("-chosen"), []).append(number)
    held_out = [p.removesuffix("-chosen") for b in bins(out / "packed-eval") for p in b["sample_ids"][0::2]]
    assert held_out and not set(held_out) & set(homes)  # whole pairs, on one side only
    twice = [bins_ for bins_ in homes.values() if len(bins_) == 2]
    assert twice and all(len(set(b)) == 2 for b in twice)  # the weighted pairs: two different bins
    assert validate.run(spark, ctx)["ok"]
