"""The JVMs that Spark's launcher starts for the tests outside mmpack's own session: the
spark-submit drivers of the README's recipes and of the DAG's tasks, the standalone
cluster's master, workers and executors, and the benchmarks' smoke runs. On the test
machine they start as mmpack's embedded JVM does for a small run (``spark.quick_jit`` and
the class archive, mmpack_udfs/io/spark.py): the optimizing compiler's start-up work and
class loading were most of their CPU (the spark-submit test, 2026-11-29: 73 s of CPU → 37 s,
its five jobs 48 s → 32 s). Only the environment changes: the commands the tests run are
the ones users run.

- ``SPARK_SUBMIT_OPTS``: options of the JVM spark-submit starts (pyspark's embedded one too),
  plus ``spark.executor.extraJavaOptions`` as a system property, which SparkConf reads: the
  executors a cluster starts for the application.
- ``SPARK_DAEMON_JAVA_OPTS``: the standalone master's and workers' own JVMs.
"""

from __future__ import annotations

from mmpack_udfs.io import class_archive
from mmpack_udfs.io.spark import QUICK_JIT


def submit_env() -> dict[str, str]:
    """The environment variable of quick spark-submit drivers and their executors."""
    options = [QUICK_JIT, *class_archive.java_options(), f"-Dspark.executor.extraJavaOptions={QUICK_JIT}"]
    return {"SPARK_SUBMIT_OPTS": " ".join(options)}


def daemon_env() -> dict[str, str]:
    """The environment variable of a quick standalone master and workers."""
    return {"SPARK_DAEMON_JAVA_OPTS": " ".join([QUICK_JIT, *class_archive.java_options()])}


if __name__ == "__main__":  # for a shell or another virtualenv (the Airflow tests): VAR=VALUE lines
    for key, value in {**submit_env(), **daemon_env()}.items():
        print(f"{key}={value}")
