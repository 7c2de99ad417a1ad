"""Normalize with input, media and output all on a real S3 API (moto server on loopback)."""

from __future__ import annotations

from collections import Counter

import boto3
import pytest

from mmpack_udfs.io import tables
from mmpack_udfs.normalize import stage as normalize
from tests.conftest import demo_run, only_dataset, with_datasets

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def upload_tree(client, bucket, root, prefix):
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():  # S3 has no symlinks
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


def test_normalize_from_and_to_s3_matches_the_local_run(spark, demo, s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    upload_tree(client, bucket, demo.root / "media", "media")
    client.upload_file(str(demo.root / "data" / "sharegpt.jsonl"), bucket, "data/sharegpt.jsonl")

    local = only_dataset(demo_run(demo, tmp_path / "local"), "sharegpt_jsonl")
    expected = normalize.run(spark, local)

    remote = with_datasets(
        demo_run(demo, f"s3://{bucket}/out", f"s3.endpoint_override={endpoint}"),
        [
            {
                "name": "sharegpt_jsonl",
                "paths": [f"s3://{bucket}/data/*.jsonl"],
                "media_root": f"s3://{bucket}/media",
            }
        ],
    )
    got = normalize.run(spark, remote)

    assert got["totals"]["read"] == expected["totals"]["read"]
    assert got["totals"]["samples"] == expected["totals"]["samples"]
    # the symlink that escapes the root locally is simply absent on S3
    shifted = Counter(expected["reasons"])
    shifted["media_path_escape"] -= 1
    shifted["media_missing"] += 1
    assert Counter(got["reasons"]) == shifted

    storage = remote.storage
    samples = tables.read_arrow(f"s3://{bucket}/out/tables/samples", storage)
    uris = [m["uri"] for media in samples.column("media").to_pylist() for m in media]
    assert uris and all(u.startswith(f"s3://{bucket}/media/") for u in uris)
    assert storage.exists(f"s3://{bucket}/out/report/normalize.json")
    assert normalize.run(spark, remote)["skipped"] is True
