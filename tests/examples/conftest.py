"""The shards the training examples' tests share (one Spark run for all of them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mmpack_udfs.demo import data as demo_data
from tests.conftest import PACKED_DEMO_SETTINGS, demo_run, family_runs


@pytest.fixture(scope="session")
def training_demo(tmp_path_factory) -> demo_data.DemoData:
    return demo_data.generate(tmp_path_factory.mktemp("ddp-demo"), samples=60, seed=12)


@pytest.fixture(scope="session")
def packed(spark, training_demo, tmp_path_factory) -> Path:
    """A small demo (images and videos) packed into 11 bins: neither 2 nor 3 divides it. One
    packing group, so the bin count depends on sample lengths only (sample ids hash the
    media paths, and the hash of an id picks its group)."""
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize

    out = tmp_path_factory.mktemp("ddp-out")
    config = demo_run(training_demo, out, *PACKED_DEMO_SETTINGS)
    normalize.run(spark, config)
    tokenize.run(spark, config)
    pack.run(spark, config)
    return out / "packed"


@pytest.fixture(scope="session")
def packed_text_and_images(spark, training_demo, packed, tmp_path_factory) -> Path:
    """The same tokenized samples packed again into 1024-token bins (longer samples skipped):
    some bins hold text only, others images."""
    from mmpack_udfs.pack import stage as pack

    out = tmp_path_factory.mktemp("ddp-small-bins")
    shutil.copytree(packed.parent / "tables", out / "tables")
    settings = [s for s in PACKED_DEMO_SETTINGS if not s.startswith("pack.budget=")]
    pack.run(spark, demo_run(training_demo, out, *settings, "pack.budget=1024"))
    return out / "packed"


@pytest.fixture(scope="session")
def training_family(spark, training_demo, packed, tmp_path_factory):
    """``training_family(name)``: the small training demo (60 samples, images and videos)
    tokenized for the family ``name`` and packed: what the family trainings run on."""
    return family_runs(spark, training_demo, packed.parent, tmp_path_factory, "training-family")
