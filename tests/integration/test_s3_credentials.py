"""The whole pipeline to an s3a:// output root on a real S3 API (moto server on loopback),
with credentials and region only from AWS profile files (no AWS_* key variables): pyarrow's
S3 and delta-rs both take them from the AWS default chain. A subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import boto3
import pytest

from mmpack_udfs.io import fs, tables

pytestmark = pytest.mark.slow


@pytest.fixture
def profile_only_env(tmp_path):
    """The environment of a machine whose AWS access is a profile in shared files."""
    credentials, config = tmp_path / "aws-credentials", tmp_path / "aws-config"
    credentials.write_text("[mmpack-test]\naws_access_key_id = from-profile\naws_secret_access_key = x\n")
    config.write_text("[profile mmpack-test]\nregion = eu-west-1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(credentials),
        AWS_CONFIG_FILE=str(config),
        AWS_PROFILE="mmpack-test",
        AWS_EC2_METADATA_DISABLED="true",  # pyarrow: no instance-role lookup
    )
    return env


def test_run_to_an_s3a_root_with_profile_credentials(demo, s3_bucket, profile_only_env, tmp_path):
    endpoint, bucket = s3_bucket
    root = f"s3a://{bucket}/runs/one"
    command = [sys.executable, "-m", "mmpack_udfs.cli", "run", "--config", str(demo.config), "--out", root,
               "--set", f"s3.endpoint_override={endpoint}", "--master", "local[2]"]  # fmt: skip
    env = profile_only_env
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/one/")["Contents"]}
    assert "runs/one/packed/manifest.json" in keys
    assert "runs/one/tables/tokenized/_delta_log/00000000000000000000.json" in keys
    manifest = client.get_object(Bucket=bucket, Key="runs/one/packed/manifest.json")["Body"].read()
    assert json.loads(manifest)["totals"]["bins"] > 0


def test_delta_on_s3_reads_profile_credentials_only_through_the_default_chain(
    demo, s3_bucket, profile_only_env, monkeypatch
):
    import deltalake
    import pyarrow as pa

    endpoint, bucket = s3_bucket
    uri = f"s3a://{bucket}/table"
    storage = fs.Storage(fs.S3Options(endpoint_override=endpoint))
    deltalake.write_deltalake(
        fs.normalize_uri(uri), pa.table({"a": [1, 2]}), storage_options=storage.delta_options(uri)
    )
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in profile_only_env.items():
        monkeypatch.setenv(key, value)
    # a Storage whose pyarrow S3 is built now, under this environment (they are cached per setup)
    storage = fs.Storage(fs.S3Options(endpoint_override=endpoint, connect_timeout=9))
    assert tables.read_arrow(fs.normalize_uri(uri), storage).column("a").to_pylist() == [1, 2]
    without_chain = {k: v for k, v in storage.delta_options(uri).items() if k != "AWS_FORCE_CREDENTIAL_LOAD"}
    # delta-rs by itself: environment variables and the instance role only, no profiles
    with pytest.raises(Exception, match=r"169\.254\.169\.254|credential"):
        deltalake.DeltaTable(fs.normalize_uri(uri), storage_options=without_chain)


def test_s3a_and_s3n_name_the_same_objects():
    assert fs.normalize_uri("s3a://bucket/a/b/") == fs.normalize_uri("s3n://bucket/a/b") == "s3://bucket/a/b"
    assert fs.is_s3("s3a://b/k") and fs.is_s3("s3n://b/k") and not fs.is_s3("s3x://b/k")
    storage = fs.Storage(fs.S3Options(region="eu-west-1"))
    assert storage.filesystem("s3a://bucket/key")[1] == "bucket/key"
    options = storage.delta_options("s3a://bucket/table")
    assert options["AWS_REGION"] == "eu-west-1" and options["AWS_FORCE_CREDENTIAL_LOAD"] == "true"
    assert not any("KEY" in k or "TOKEN" in k for k in options)  # credentials never pass through mmpack
