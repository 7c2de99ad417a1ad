"""The shards the training examples' tests share (one Spark run for all of them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import PACKED_DEMO_SETTINGS, demo_run, fresh_output

# Images of at most 128 tokens (100,352 px) in 2,048-token bins: the trainings' steps cost about
# half of what the default profile's images (up to 1,280 tokens) in 4,096-token bins cost.
TRAINING_SETTINGS = (
    *PACKED_DEMO_SETTINGS,
    "pack.budget=2048",
    "profiles.qwen2_vl.image.max_pixels=100352",
)


@pytest.fixture(scope="session")
def packed(spark, family_demo, family_tables, tmp_path_factory) -> Path:
    """A small demo (images and videos) packed into 11 bins: neither 2 nor 3 divides it. One
    packing group, so the bin count depends on sample lengths only (sample ids hash the
    media paths, and the hash of an id picks its group)."""
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize

    out = fresh_output(family_tables, tmp_path_factory.mktemp("ddp"))
    config = demo_run(family_demo, out, *TRAINING_SETTINGS)
    tokenize.run(spark, config)
    pack.run(spark, config)
    return out / "packed"


@pytest.fixture(scope="session")
def packed_text_and_images(spark, family_demo, packed, tmp_path_factory) -> Path:
    """The samples tokenized with the default profile (images up to 1,280 tokens) and packed
    into 1024-token bins (longer samples skipped): some bins hold text only, others images."""
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize

    out = tmp_path_factory.mktemp("ddp-small-bins")
    shutil.copytree(packed.parent / "tables", out / "tables")
    settings = [s for s in PACKED_DEMO_SETTINGS if not s.startswith("pack.budget=")]
    ctx = demo_run(family_demo, out, *settings, "pack.budget=1024")
    tokenize.run(spark, ctx)
    pack.run(spark, ctx)
    return out / "packed"
