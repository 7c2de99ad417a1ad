"""The SparkSession factory: embedded ``local[*]`` by default, any master when given.

Under spark-submit the session takes the master and settings spark-submit passed;
everywhere, settings from the config's ``spark.conf`` apply, and the executor Python
environment is set up the same way (``PYSPARK_PYTHON``, ``TOKENIZERS_PARALLELISM``).
"""

from __future__ import annotations

import os
import sys

import pyarrow as pa

from mmpack_udfs.config.model import SparkConfig

EXECUTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "OPENCV_LOG_LEVEL": "ERROR",
    "OPENCV_FFMPEG_LOGLEVEL": "-8",
}


def under_spark_submit() -> bool:
    """True when spark-submit launched this Python driver (it hands over a gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def session_settings(spark_config: SparkConfig, master: str | None = None) -> dict[str, str]:
    """Every Spark setting the session is built with, as strings (pure; easy to test)."""
    settings = {"spark.app.name": spark_config.app_name}
    if not under_spark_submit():
        settings["spark.master"] = master or spark_config.master
        # Executors in local mode run this interpreter, so they see the same packages.
        settings["spark.pyspark.python"] = sys.executable
        settings["spark.pyspark.driver.python"] = sys.executable
    for key, value in EXECUTOR_ENV.items():
        settings[f"spark.executorEnv.{key}"] = value
    settings["spark.sql.execution.arrow.pyspark.enabled"] = "true"
    for key, value in spark_config.conf.items():
        settings[str(key)] = str(value).lower() if isinstance(value, bool) else str(value)
    return settings


def get_spark(spark_config: SparkConfig, master: str | None = None):
    """Build (or reuse) the SparkSession for a job; returns ``pyspark.sql.SparkSession``."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in EXECUTOR_ENV.items():
        os.environ.setdefault(key, value)
    builder = SparkSession.builder
    for key, value in session_settings(spark_config, master).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(spark_config.log_level.upper())
    return spark


TASK_COLUMN = "_mmpack_task"


def one_task_per_row(spark, table: pa.Table):
    """A DataFrame with each row of ``table`` (a few small work items: units, splits, files,
    shards) in a partition of its own, so a mapInArrow over it runs one Spark task per item.

    ``createDataFrame(...).repartition(n)`` does not give that: it deals rows round-robin
    from a random start, so some tasks get two items and others none, and it adds a shuffle.
    Here a range of n partitions (one id each) is joined with the broadcast items: no
    shuffle, and no Python pass to convert the rows.
    """
    from pyspark.sql.functions import broadcast

    n = table.num_rows
    items = spark.createDataFrame(table.append_column(TASK_COLUMN, pa.array(range(n), pa.int64())))
    tasks = spark.range(n, numPartitions=max(n, 1)).withColumnRenamed("id", TASK_COLUMN)
    return tasks.join(broadcast(items), TASK_COLUMN).drop(TASK_COLUMN)
