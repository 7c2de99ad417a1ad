"""What the benchmark scripts share: where results go, the Spark session, the machine line."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mmpack_udfs.config.model import SparkConfig
from mmpack_udfs.io.spark import get_spark

OUT = Path(__file__).resolve().parent / "out"


def bench_spark(master: str, driver_memory: str = "4g"):
    """A quiet local SparkSession for benchmarks."""
    OUT.mkdir(parents=True, exist_ok=True)
    conf = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": driver_memory,
        "spark.sql.shuffle.partitions": "8",
    }
    return get_spark(SparkConfig(master=master, log_level="ERROR", conf=conf))


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on loopback, in its own process; yields its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
