"""Dataset weights, caps and the evaluation split on a real Spark pack of the demo data:
exact copies in different bins, exact subsets and caps, a re-run that chooses the same,
an evaluation pack disjoint by conversation that validates and that the loader reads
exactly once across ranks and workers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from loader import PackedDataset
from mmpack_udfs.io import fs, tables
from mmpack_udfs.pack import gc
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.validate import stage as validate
from tests.conftest import (
    CAP,
    EVAL_SAMPLES,
    FRACTION,
    LOSS_WEIGHTS,
    PACKED_DEMO_SETTINGS,
    demo_run,
    fresh_output,
    mixed_run,
    with_datasets,
)

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def mixed(mixed_demo):
    return mixed_demo


def placements(root: Path, columns: tuple[str, ...] = ("sample_ids", "sample_datasets")) -> list[tuple]:
    """(sample_id, dataset, ..., bin number) of every sample in a pack's shards: each sample's
    entry of the per-sample ``columns``, then its bin's number."""
    manifest = json.loads((root / "manifest.json").read_text())
    out, bin_number = [], 0
    for shard in manifest["shards"]:
        table = pq.read_table(root / shard["path"], columns=list(columns))
        for row in zip(*(table[c].to_pylist() for c in columns), strict=True):
            out += [(*sample, bin_number) for sample in zip(*row, strict=True)]
            bin_number += 1
    return out


def tokenized(out: Path) -> dict[str, tuple[str, str]]:
    uri = str(out / "tables" / "tokenized")
    rows = tables.read_arrow(uri, fs.LOCAL, columns=["sample_id", "parent_id", "dataset"])
    return {s: (p, d) for s, p, d in zip(*(rows[c].to_pylist() for c in rows.column_names), strict=True)}


def test_weights_caps_and_the_eval_split_are_exact(mixed):
    out, _ = mixed
    rows, skipped = (
        tokenized(out),
        {s["sample_id"] for s in json.loads((out / "report/pack_skipped.json").read_text())},
    )
    train, evaluation = placements(out / "packed"), placements(out / "packed-eval")
    copies = Counter(s for s, _, _ in train)
    held_out = {s for s, _, _ in evaluation}
    assert len(held_out) == len(evaluation)  # evaluation samples once, never weighted
    # disjoint by conversation
    assert not {rows[s][0] for s in held_out} & {rows[s][0] for s in copies}
    by_dataset = {name: [s for s, (_, d) in rows.items() if d == name and s not in skipped] for name in
                  ("sharegpt_jsonl", "openai_json", "custom_parquet")}  # fmt: skip
    pool = {name: [s for s in ids if s not in held_out] for name, ids in by_dataset.items()}
    # weight 2.0: every training sample exactly twice, in two different bins
    assert pool["sharegpt_jsonl"] and all(copies[s] == 2 for s in pool["sharegpt_jsonl"])
    assert len(set(train)) == len(train) and len({(s, b) for s, _, b in train}) == len(train)
    # weight 0.3: exactly round(0.3 n) distinct samples, once each
    chosen = [s for s in pool["openai_json"] if copies[s]]
    assert len(chosen) == int(np.floor(0.3 * len(pool["openai_json"]) + 0.5)) and all(
        copies[s] == 1 for s in chosen
    )
    # max_samples caps exactly; eval_samples holds out exactly
    assert sum(1 for s in pool["custom_parquet"] if copies[s]) == CAP
    assert sum(1 for s in held_out if rows[s][1] == "custom_parquet") == EVAL_SAMPLES
    # the dataset travels with every sample
    assert all(rows[s][1] == d for s, d, _ in train + evaluation)
    manifest = json.loads((out / "packed/manifest.json").read_text())
    assert manifest["mix"]["sharegpt_jsonl"]["train_copies"] == 2 * len(pool["sharegpt_jsonl"])
    assert manifest["eval"]["samples"] == len(held_out) and manifest["datasets"] == sorted(by_dataset)
    found = gc.collect(str(out), dry_run=True)  # both packs' files are named
    assert found["unnamed"] == [] and found["kept"] == len(list(out.glob("packed*/shards/*/*.parquet")))
    report = json.loads((out / "report/pack.json").read_text())
    assert report["mix"] == manifest["mix"] and report["eval"] == manifest["eval"]


def test_the_mixed_run_validates_and_a_broken_copy_count_fails(spark, mixed, tmp_path):
    out, ctx = mixed
    summary = validate.run(spark, ctx)
    assert summary["ok"] and summary["eval_samples"] > 0
    # the source-side check on its own: a sample missing from the training pack is found
    packed_ids = spark.createDataFrame(
        [(s,) for s, _, _ in placements(out / "packed")][1:], "sample_id string"
    )
    eval_ids = spark.createDataFrame(
        [(s,) for s, _, _ in placements(out / "packed-eval")], "sample_id string"
    )
    manifest = json.loads((out / "packed/manifest.json").read_text())
    skipped = [s["sample_id"] for s in json.loads((out / "report/pack_skipped.json").read_text())]
    found = validate.source_problems(spark, manifest, packed_ids, eval_ids, skipped, ctx.storage)
    assert found["problems"] and "fewer training bins than its copies" in found["problems"][0]


def test_a_rerun_chooses_the_same_samples(spark, demo, tokenized_demo, mixed, tmp_path):
    out, _ = mixed
    again = fresh_output(tokenized_demo, tmp_path)
    pack.run(spark, mixed_run(demo, again))
    for name in ("packed", "packed-eval"):
        first, second = (json.loads((o / name / "manifest.json").read_text()) for o in (out, again))
        assert [s["sha256"] for s in first["shards"]] == [s["sha256"] for s in second["shards"]]


def test_a_file_added_to_a_dataset_moves_no_conversation_and_keeps_subsets_nested(
    spark, demo, mixed, tmp_path
):
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.tokenize import stage as tokenize

    out, ctx = mixed
    grown = []  # openai_json (weight 0.3) gains the ShareGPT file; that dataset goes
    for entry in ctx.config.as_dict()["datasets"]:
        if entry["name"] == "openai_json":
            grown.append({**entry, "paths": [*entry["paths"], "data/sharegpt.jsonl"], "dialect": "auto"})
        elif entry["name"] != "sharegpt_jsonl":
            grown.append(entry)
    base = demo_run(demo, tmp_path / "out", *PACKED_DEMO_SETTINGS, f"eval.fraction={FRACTION}")
    bigger = with_datasets(base, grown)
    for stage in (normalize, tokenize, pack):
        stage.run(spark, bigger)

    def sides(root: Path) -> tuple[set[str], set[str], set[str]]:
        rows = tokenized(root)
        mine = {p for p, d in rows.values() if d == "openai_json"}
        train = {rows[s][0] for s, _, _ in placements(root / "packed")} & mine
        return mine, train, {rows[s][0] for s, _, _ in placements(root / "packed-eval")} & mine

    old, old_train, old_eval = sides(out)
    new, new_train, new_eval = sides(tmp_path / "out")
    assert old < new  # the file added conversations
    assert new_eval & old == old_eval  # a conversation's side never changes
    kept = new_train & old
    assert kept <= old_train or old_train <= kept  # the k smallest hashes: nested choices
    manifest = json.loads((tmp_path / "out/packed/manifest.json").read_text())
    mix = manifest["mix"]["openai_json"]
    pool = mix["samples"] - mix["eval_samples"] - mix["over_budget_rows"]
    assert mix["train_samples"] == int(np.floor(0.3 * pool + 0.5))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_the_eval_split_is_read_exactly_once_across_ranks(mixed, world, workers):
    out, _ = mixed
    expected = Counter(s for s, _, _ in placements(out / "packed-eval"))
    seen, steps = Counter(), []
    for rank in range(world):
        data = PackedDataset(str(out / "packed"), split="eval", rank=rank, world_size=world, shuffle=False,
                             with_media=False)  # fmt: skip
        assert data.manifest["split"] == "eval"
        batches = list(DataLoader(data, batch_size=1, num_workers=workers, collate_fn=lambda items: items))
        steps.append(len(batches))
        for batch in batches:
            for item in batch:
                seen.update(item["sample_ids"])
                if item["filler"]:
                    assert not (item["labels"] != -100).any()
    assert seen == expected and len(set(steps)) == 1


def test_a_run_without_an_eval_split_says_so(packed_demo):
    with pytest.raises(Exception, match="no evaluation split"):
        PackedDataset(str(packed_demo / "packed"), split="eval")


def test_the_trainer_evaluates_the_split_overall_and_per_dataset(mixed, tmp_path):
    import torch
    from transformers import TrainingArguments

    from loader import collate_packed
    from loader.trainer import PackedTrainer
    from loader.training import token_losses
    from tests.loader.test_training import tiny_qwen2_vl

    out, _ = mixed
    model = tiny_qwen2_vl()
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    metrics = PackedTrainer(model, args, manifest=str(out / "packed"), eval_split=True).evaluate()
    # by hand: every evaluation bin on its own, each token's loss to its sample's dataset
    sums, tokens = Counter(), Counter()
    with torch.no_grad():
        for item in PackedDataset(str(out / "packed"), split="eval", shuffle=False):
            losses, positions = token_losses(model, collate_packed([item]))
            sample = torch.searchsorted(item["cu_seqlens"].to(torch.int64), positions, right=True) - 1
            for loss, index in zip(losses.tolist(), sample.tolist(), strict=True):
                sums[item["sample_datasets"][index]] += loss
                tokens[item["sample_datasets"][index]] += 1
    assert metrics["eval_tokens"] == sum(tokens.values()) > 0
    assert metrics["eval_loss"] == pytest.approx(sum(sums.values()) / sum(tokens.values()), rel=1e-5)
    for name in tokens:
        assert metrics[f"eval_loss/{name}"] == pytest.approx(sums[name] / tokens[name], rel=1e-5)


def weighted_placements(root: Path) -> list[tuple[str, str, float, int]]:
    """(sample_id, dataset, loss weight, bin number) of every sample in a pack's shards."""
    return placements(root, ("sample_ids", "sample_datasets", "sample_weights"))


def test_loss_weights_reach_every_copy_and_the_evaluation_split_and_move_nothing(mixed, weighted_demo):
    out, _ = weighted_demo
    for pack_dir in ("packed", "packed-eval"):
        weighted = weighted_placements(out / pack_dir)
        assert [w for _, d, w, _ in weighted] == [LOSS_WEIGHTS.get(d, 1.0) for _, d, _, _ in weighted]
        # the same bins as without loss weights: a weight changes the loss, not the packing
        assert [(s, d, b) for s, d, _, b in weighted] == placements(mixed[0] / pack_dir)
    train = weighted_placements(out / "packed")
    assert {d for _, d, w, _ in train if w != 1} == set(LOSS_WEIGHTS)  # copies (weight 2) included
    assert {d for _, d, w, _ in weighted_placements(out / "packed-eval") if w != 1} == set(LOSS_WEIGHTS)
    manifest = json.loads((out / "packed/manifest.json").read_text())
    assert manifest["totals"]["weighted_samples"] == sum(w != 1 for _, _, w, _ in train)


def test_a_weighted_packed_loss_is_the_weighted_sum_of_each_sample_alone(weighted_demo):
    """summed_loss (what PackedTrainer's step sums) on two bins of a real tiny Qwen2-VL equals
    Σ weight × (the sample's summed loss run alone, as transformers computes it)."""
    import itertools

    import torch

    from loader import collate_packed
    from loader.training import summed_loss
    from tests.loader.test_model_parity import alone, sample_media
    from tests.loader.test_training import tiny_qwen2_vl

    out, _ = weighted_demo
    bins = [b for b in PackedDataset(str(out / "packed"), shuffle=False) if len(set(b["sample_weights"])) > 1]
    batch = collate_packed(sorted(bins, key=lambda b: len(b["input_ids"]))[:2])
    weights, cu = batch.meta["sequence_weights"], batch.meta["cu_seq_lens"]
    assert len(set(weights)) > 1 and len(weights) == len(cu) - 1
    model = tiny_qwen2_vl().eval()
    expected, unweighted = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        packed = summed_loss(model, batch).double()
        media = sample_media(batch, cu)
        for (a, b), weight, mine in zip(itertools.pairwise(cu), weights, media, strict=True):
            labels = batch["labels"][0, a:b]
            supervised = int((labels[1:] != -100).sum())
            if supervised:
                single = alone(model, batch["input_ids"][0, a:b], labels, mine).loss.double() * supervised
                expected += weight * single
                unweighted += single
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=0)
    assert abs(packed - unweighted) > 1e-3 * unweighted  # the weights matter in this batch
