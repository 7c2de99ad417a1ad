"""What the benchmark scripts share: where results go, the Spark session, the machine line."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from mmpack_udfs.spark import get_spark

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
    return get_spark({"master": master, "log_level": "ERROR", "conf": conf})


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
