"""The SparkSession factory: embedded ``local[*]`` by default, any master when given.

Under spark-submit the session takes the master and settings spark-submit passed;
everywhere, settings from the config's ``spark.conf`` apply, and the executor Python
environment is set up the same way (``PYSPARK_PYTHON``, ``TOKENIZERS_PARALLELISM``).

Quiet by default: an embedded JVM starts with ``log4j2.properties`` (errors only) and its
stderr passes through a filter that drops the JVM's own start-up warnings, so a command
prints only its own lines; ``verbose`` gives Spark's default logging back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import pyarrow as pa

from mmpack_udfs.io import class_archive, worker_daemon

if TYPE_CHECKING:  # not imported at run time: a Python worker that imports this needs no pydantic
    from mmpack_udfs.config.model import SparkConfig

EXECUTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "OPENCV_LOG_LEVEL": "ERROR",
    "OPENCV_FFMPEG_LOGLEVEL": "-8",
}


def under_spark_submit() -> bool:
    """True when spark-submit launched this Python driver (it hands over a gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


QUIET_LOG4J = Path(__file__).with_name("log4j2.properties")
JVM_NOISE = (  # printed to stderr directly (by the JVM; by Spark for a shell), not through log4j
    b"WARNING: Using incubator modules",
    b'Setting default log level to "',
    b"To adjust logging level use sc.setLogLevel(",
)
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
QUICK_JIT = "-XX:TieredStopAtLevel=1"  # C1 only: given first, so a user's own -XX option wins
QUICK_JIT_INPUT_BYTES = 256 << 20  # spark.quick_jit = null: quick below this much input
DRIVER_MEMORY = "spark.driver.memory"
UI_ENABLED = "spark.ui.enabled"  # off for an embedded local run unless the config turns it on
DAEMON_MODULE = "spark.python.daemon.module"  # local: workers import pyspark from its package


def quick_jit(spark_config: SparkConfig, input_bytes: int | None) -> bool:
    """Whether the embedded JVM compiles with C1 only: ``spark.quick_jit``, or where it is null,
    whether the run's input files (``input_bytes``; None: not known) are small."""
    if spark_config.quick_jit is not None:
        return spark_config.quick_jit
    return input_bytes is not None and input_bytes < QUICK_JIT_INPUT_BYTES


def session_settings(
    spark_config: SparkConfig,
    master: str | None = None,
    verbose: bool = False,
    input_bytes: int | None = None,
    java_options: Sequence[str] = (),
) -> dict[str, str]:
    """Every Spark setting the session is built with, as strings (pure; easy to test).
    ``input_bytes``: the size of the run's input files where known (``quick_jit``);
    ``java_options``: more options for the embedded JVM, before the user's (``class_archive``)."""
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
    if not under_spark_submit():  # the embedded JVM starts with ours around the user's options
        if settings["spark.master"].startswith("local"):
            settings.setdefault(DRIVER_MEMORY, local_driver_memory())
            # a command prints its own progress; the web UI's server costs ~1 s of each start
            settings.setdefault(UI_ENABLED, "false")
            settings.setdefault(DAEMON_MODULE, worker_daemon.__name__)
        before = [QUICK_JIT] if quick_jit(spark_config, input_bytes) else []
        before += java_options
        after = [] if verbose else [f"-Dlog4j2.configurationFile={QUIET_LOG4J.resolve().as_uri()}"]
        if before or after:
            given = settings.get(DRIVER_JAVA_OPTIONS, "")
            settings[DRIVER_JAVA_OPTIONS] = " ".join(o for o in [*before, given, *after] if o)
    return settings


def local_driver_memory() -> str:
    """The embedded local JVM's heap where the config sets none: a quarter of this machine's
    memory, 1 to 16 GiB. (Spark's own default, 1 GiB, ran out of heap in normalize's sort on a
    million text-only records: bench/RESULTS.md.)"""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{min(max(total >> 32, 1), 16)}g"


def log_level(spark_config: SparkConfig, verbose: bool) -> str:
    """The level set once the session runs: the config's, at least WARN when ``verbose``."""
    level = spark_config.log_level.upper()
    return "WARN" if verbose and level in ("ERROR", "FATAL", "OFF") else level


def get_spark(
    spark_config: SparkConfig,
    master: str | None = None,
    verbose: bool = False,
    input_bytes: int | None = None,
):
    """Build (or reuse) the SparkSession for a job; returns ``pyspark.sql.SparkSession``.
    ``input_bytes``: the size of the run's input files where known (``quick_jit``)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in EXECUTOR_ENV.items():
        os.environ.setdefault(key, value)
    archive = [] if under_spark_submit() else class_archive.java_options()  # its JVM runs already
    settings = session_settings(spark_config, master, verbose, input_bytes, archive)
    if not verbose and not under_spark_submit() and SparkContext._active_spark_context is None:
        conf = SparkConf().setAll(list(settings.items()))
        SparkContext(conf=conf, gateway=_filtered_gateway(conf))
    builder = SparkSession.builder
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level(spark_config, verbose))
    return spark


def _filtered_gateway(conf):
    """Start the JVM with its stderr through ``forward_stderr`` (drops ``JVM_NOISE``)."""
    from pyspark.java_gateway import launch_gateway

    gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
    forwarder = threading.Thread(target=forward_stderr, args=(gateway.proc.stderr,), daemon=True)
    forwarder.start()
    return gateway


def forward_stderr(source: IO[bytes], fd: int = 2) -> None:
    """Copy the JVM's stderr (and its Python workers') line by line to ``fd``, except
    ``JVM_NOISE``. It never stops reading while the JVM lives: a JVM whose stderr pipe
    fills up would block."""
    for line in iter(source.readline, b""):
        if line.startswith(JVM_NOISE):
            continue
        with contextlib.suppress(OSError):  # nowhere to write: drop the line, keep draining
            os.write(fd, line)


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
