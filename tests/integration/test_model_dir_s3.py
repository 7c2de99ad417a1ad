"""``tokenize.model`` as an ``s3://`` prefix (the real S3 API of a moto server on loopback):
copied once to a local cache, resolved like a local directory, the same tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import boto3
import pytest

from mmpack_udfs.io import fs, tables
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.tokenize import stage as tokenize
from mmpack_udfs.tokenize.encoder import TokenizeSettings
from tests.conftest import demo_run

pytestmark = pytest.mark.spark


def test_an_s3_model_directory_tokenizes_as_the_local_one(
    spark, demo, family_run, s3_bucket, tmp_path, monkeypatch
):
    endpoint, bucket = s3_bucket
    local = family_run("qwen2_5_vl")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for file in Path(local.model_dir).iterdir():
        client.upload_file(str(file), bucket, f"models/qwen25/{file.name}")
    client.put_object(Bucket=bucket, Key="models/qwen25/model-00001.safetensors", Body=b"weights")
    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "cache"))

    out = tmp_path / "out"
    out.mkdir()
    import shutil

    shutil.copytree(local.output / "tables" / "samples", out / "tables" / "samples")
    ctx = demo_run(
        demo, out, f"tokenize.model=s3://{bucket}/models/qwen25", f"s3.endpoint_override={endpoint}"
    )
    config = ctx.config
    copy = Path(config.tokenize.tokenizer)
    assert copy.is_relative_to(tmp_path / "cache") and (copy / "tokenizer.json").exists()
    assert not (copy / "model-00001.safetensors").exists()  # weights are never fetched
    assert config.profiles["model"] == local.ctx.config.profiles["model"]
    summary = tokenize.run(spark, ctx)
    assert summary["model"]["source"] == f"s3://{bucket}/models/qwen25"

    def rows(root):
        table = tables.read_arrow(table_uri(str(root), "tokenized")).select(
            ["sample_id", "input_ids", "labels"]
        )
        return sorted(table.to_pylist(), key=lambda r: r["sample_id"])

    assert rows(out) == rows(local.output)

    # an executor without the driver's copy fetches its own
    settings = TokenizeSettings.from_config(config)
    elsewhere = dataclasses.replace(settings, tokenizer_path=str(tmp_path / "not-here"))
    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "executor-cache"))
    fetched = elsewhere.on_this_machine(fs.Storage(fs.S3Options.from_config(config.s3)))
    assert Path(fetched.tokenizer_path).is_relative_to(tmp_path / "executor-cache")
    assert (Path(fetched.tokenizer_path) / "tokenizer.json").read_bytes() == (
        copy / "tokenizer.json"
    ).read_bytes()
