"""The bad-input corpus (tests/corpus/build_corpus.py) through the whole pipeline: every
record becomes a sample or a quarantine row with a documented reason, what is packed
validates, and one loader epoch with media reads every bin."""

from __future__ import annotations

import json

import pytest
import torch

from loader import PackedDataset, collate_packed
from mmpack_udfs.reasons import DESCRIPTIONS
from mmpack_udfs.resolve import load_run
from tests.corpus.build_corpus import build

pytestmark = [pytest.mark.spark, pytest.mark.slow]

IMAGE_PAD, VIDEO_PAD = 151655, 151656


def record_weights(out) -> dict[str, float]:
    """Tokenized sample id → the weight its record gave (the samples table's, by parent)."""
    from mmpack_udfs.io import fs, tables

    def read(name: str, *columns: str) -> list[list]:
        rows = tables.read_arrow(str(out / "tables" / name), fs.LOCAL, columns=list(columns))
        return [rows[c].to_pylist() for c in columns]

    weight = dict(zip(*read("samples", "sample_id", "weight"), strict=True))
    return {s: weight[p] for s, p in zip(*read("tokenized", "sample_id", "parent_id"), strict=True)}


def shard_weights(packed, manifest) -> dict[str, float]:
    """sample id → its weight in the shards."""
    import pyarrow.parquet as pq

    found = {}
    for shard in manifest["shards"]:
        table = pq.read_table(packed / shard["path"], columns=["sample_ids", "sample_weights"])
        ids, weights = table["sample_ids"].to_pylist(), table["sample_weights"].to_pylist()
        for bin_ids, bin_weights in zip(ids, weights, strict=True):
            found.update(zip(bin_ids, bin_weights, strict=True))
    return found


def test_the_corpus_goes_through_the_pipeline_and_the_loader(spark, tmp_path, capsys):
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize
    from mmpack_udfs.validate import stage as validate

    corpus = build(tmp_path / "corpus")
    assert len(corpus.kinds) >= 60 and len(set(corpus.kinds)) == len(corpus.kinds)
    settings = [f"output={tmp_path / 'out'}", "pack.budget=400", "pack.oversize=skip"]  # several bins
    config = load_run(corpus.config, settings)
    documented = {str(reason) for reason in DESCRIPTIONS}

    normalized = normalize.run(spark, config)  # raises unless read = samples + quarantined + duplicates
    counts = normalized["totals"]
    assert counts["read"] == corpus.records
    assert counts["read"] == counts["samples"] + counts["quarantined"] + counts["duplicates"]
    assert set(normalized["reasons"]) <= documented
    assert counts["samples"] >= 20 and counts["quarantined"] >= 30

    tokenized = tokenize.run(spark, config)
    t = tokenized["counts"]
    assert t["samples_in"] == counts["samples"] == t["tokenized_samples"] + t["quarantined"]
    assert set(tokenized["reasons"]) <= documented

    pack.run(spark, config)
    summary = validate.run(spark, config)
    assert summary["ok"], summary["problems"]
    assert summary["source"]["rows"] == summary["samples"] + summary["skipped"]

    assert normalized["reasons"]["invalid_weight"] == 4  # as text, negative, boolean, NaN
    assert normalized["reasons"]["tar_unreadable"] == 1  # the cut tar (its first key is a sample)
    manifest = json.loads((tmp_path / "out" / "packed" / "manifest.json").read_text())
    recorded = record_weights(tmp_path / "out")
    packed = shard_weights(tmp_path / "out" / "packed", manifest)
    assert packed == {s: recorded[s] for s in packed}  # each sample's weight, from its record
    assert sorted(w for w in packed.values() if w != 1) == [0.0, 0.5]  # null: 1
    assert manifest["totals"]["weighted_samples"] == 2
    bins = 0
    for item in PackedDataset(str(tmp_path / "out" / "packed"), shuffle=False):  # with media
        batch = collate_packed([item])
        ids = batch["input_ids"]
        assert batch.get("pixel_values", torch.zeros(0, 1176)).shape[0] // 4 == int((ids == IMAGE_PAD).sum())
        assert batch.get("pixel_values_videos", torch.zeros(0, 1176)).shape[0] // 4 == int(
            (ids == VIDEO_PAD).sum()
        )
        bins += 1
    assert bins == manifest["totals"]["bins"] >= 3
    assert "Traceback" not in capsys.readouterr().err
