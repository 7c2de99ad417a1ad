"""``tokenize.model`` as an ``s3://`` prefix (the real S3 API of a moto server on loopback):
listed and read once per run, copied once to a local cache, resolved like a local directory,
the same tokens."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

import boto3
import pytest

from mmpack_udfs.io import tables
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.tokenize import stage as tokenize
from mmpack_udfs.tokenize.encoder import TokenizeSettings
from tests.conftest import PACKED_DEMO_SETTINGS, demo_run, moto_server

pytestmark = pytest.mark.spark


MODEL_PREFIX = "models/qwen25"


def model_requests(log: Path) -> list[tuple[str, str]]:
    """(method, path and query) of every request the server logged for the model directory."""
    found = []
    for line in log.read_text().splitlines():
        request = re.search(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP', line)
        if request and MODEL_PREFIX in unquote(request.group(2)):
            found.append((request.group(1), unquote(request.group(2))))
    return found


def reads(requests: list[tuple[str, str]], method: str) -> list[str]:
    """The file names of the ``method`` requests on files (not listings), sorted."""
    return sorted(path.rsplit("/", 1)[1] for m, path in requests if m == method and "?" not in path)


def test_an_s3_model_directory_is_read_once_a_run_and_tokenizes_as_the_local_one(
    spark, family_demo, family_run, tmp_path, monkeypatch
):
    local = family_run("qwen2_5_vl")
    log = tmp_path / "requests.log"
    with log.open("w") as sink, moto_server(sink) as endpoint:
        bucket = "mmpack-models"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        files = sorted(Path(local.model_dir).iterdir())
        for file in files:
            client.upload_file(str(file), bucket, f"{MODEL_PREFIX}/{file.name}")
        client.put_object(Bucket=bucket, Key=f"{MODEL_PREFIX}/model-00001.safetensors", Body=b"weights")
        uploaded = len(model_requests(log))
        monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "cache"))

        out = tmp_path / "out"
        shutil.copytree(local.output / "tables" / "samples", out / "tables" / "samples")
        source = f"s3://{bucket}/{MODEL_PREFIX}"
        settings = (f"tokenize.model={source}", f"s3.endpoint_override={endpoint}", *PACKED_DEMO_SETTINGS)
        ctx = demo_run(family_demo, out, *settings)
        summary = tokenize.run(spark, ctx)
        pack.run(spark, ctx)
        requests = model_requests(log)[uploaded:]

        # an executor without the driver's copy fetches the files the run start listed
        settings = TokenizeSettings.from_config(ctx.config, ctx.model)
        elsewhere = dataclasses.replace(settings, tokenizer_path=str(tmp_path / "not-here"))
        monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "executor-cache"))
        fetched = elsewhere.on_this_machine(ctx.storage)
        executor_requests = model_requests(log)[uploaded + len(requests) :]

    # one listing, and one read (pyarrow: a HEAD, then a GET) of each file but the weights, for
    # the whole tokenize + pack run
    names = sorted(f.name for f in files)
    listings = [path for _, path in requests if "list-type=2" in path]
    assert len(listings) == 1, requests
    assert reads(requests, "GET") == reads(requests, "HEAD") == names, requests

    config = ctx.config
    copy = Path(config.tokenize.tokenizer)
    assert copy.is_relative_to(tmp_path / "cache") and (copy / "tokenizer.json").exists()
    assert not (copy / "model-00001.safetensors").exists()  # weights are never fetched
    assert config.profiles["model"] == local.ctx.config.profiles["model"]
    assert summary["model"]["source"] == source
    manifest = json.loads((out / "packed" / "manifest.json").read_text())
    local_manifest = json.loads((local.output / "packed" / "manifest.json").read_text())
    expected = json.loads(json.dumps(local_manifest["model"]).replace(str(local.model_dir), source))
    assert manifest["model"] == expected  # the same record, naming the s3:// source

    def rows(root):
        table = tables.read_arrow(table_uri(str(root), "tokenized")).select(
            ["sample_id", "input_ids", "labels"]
        )
        return sorted(table.to_pylist(), key=lambda r: r["sample_id"])

    assert rows(out) == rows(local.output)

    # the executor lists nothing: it reads each listed file once
    assert not [path for _, path in executor_requests if "list-type=2" in path], executor_requests
    assert reads(executor_requests, "GET") == reads(executor_requests, "HEAD") == names, executor_requests
    assert Path(fetched.tokenizer_path).is_relative_to(tmp_path / "executor-cache")
    assert (Path(fetched.tokenizer_path) / "tokenizer.json").read_bytes() == (
        copy / "tokenizer.json"
    ).read_bytes()
