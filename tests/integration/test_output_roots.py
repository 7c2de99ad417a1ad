"""An output root whose name has a space, '#' and non-ASCII letters works end to end."""

from __future__ import annotations

import json

import pytest

from loader import PackedDataset
from tests.conftest import PACKED_DEMO_SETTINGS, demo_run

pytestmark = pytest.mark.spark


def test_pipeline_and_loader_in_a_root_with_space_hash_and_non_ascii(spark, demo, tmp_path):
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize
    from mmpack_udfs.validate import stage as validate

    out = tmp_path / "run 1 #ü"
    config = demo_run(demo, out, *PACKED_DEMO_SETTINGS)
    normalize.run(spark, config)
    tokenize.run(spark, config)
    pack.run(spark, config)
    summary = validate.run(spark, config)
    assert summary["ok"], summary
    assert summary["source"]["checked"]  # every tokenized sample in exactly one bin or skipped
    assert summary["source"]["rows"] == summary["samples"] + summary["skipped"]
    manifest = json.loads((out / "packed" / "manifest.json").read_text())
    bins = list(PackedDataset(str(out / "packed"), with_media=False))
    assert len(bins) == manifest["totals"]["bins"] > 0
    assert sum(len(b["sample_ids"]) for b in bins) == manifest["totals"]["samples"] == summary["samples"]
