"""Shared fixtures: one local SparkSession, one moto S3 server and one demo dataset per run."""

from __future__ import annotations

import os
import socket

import pytest

from mmpack_udfs import demo_data
from mmpack_udfs.config import load_config

TEST_SPARK = {
    "master": "local[2]",
    "app_name": "mmpack-tests",
    "log_level": "ERROR",
    "conf": {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "2",
        "spark.driver.memory": "2g",
    },
}


@pytest.fixture(scope="session")
def spark():
    from mmpack_udfs.spark import get_spark

    session = get_spark(TEST_SPARK)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> demo_data.DemoData:
    """A small demo dataset (real media, every kind of bad record), generated once."""
    return demo_data.generate(tmp_path_factory.mktemp("demo"), samples=150, seed=7)


def demo_config(demo: demo_data.DemoData, output, *overrides: str) -> dict:
    config = load_config(demo.config, [f"output={output}", *overrides])
    config["spark"] = TEST_SPARK
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto's server) on loopback; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        os.environ[key] = value
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the loopback S3 server; yields (endpoint, bucket name)."""
    import boto3

    name = "mmpack-" + request.node.name.lower().replace("_", "-")[:40]
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return s3_server, name
