"""Spark's Python daemon (``pyspark.daemon``), importing pyspark from the installed package
instead of from ``pyspark.zip``.

Spark starts an executor's Python daemon with ``$SPARK_HOME/python/lib/pyspark.zip`` first on
its path, and Python compiles a module it imports from a zip anew each time (a zip holds no
bytecode cache): the daemon and every worker it forks spent about 0.7 s compiling pyspark's
modules before their first task (bench/RESULTS.md). Where that zip is the one inside the
installed pyspark package (pip's pyspark: the same files), the daemon takes it off its path
first, so it and its workers import those modules from the package and its cached bytecode.
Any other zip (a SPARK_HOME of its own) stays: it is the one its JVM matches.

Standard library only before pyspark. The embedded local session names it in
``spark.python.daemon.module`` (``spark.session_settings``); executors elsewhere start
Spark's own daemon.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys


def without_packaged_zip(path: list[str]) -> list[str]:
    """``path`` less the ``pyspark.zip`` that lies inside the pyspark package it also holds."""
    unzipped = [entry for entry in path if not entry.endswith(".zip")]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", unzipped)
    if spec is None or spec.origin is None:
        return list(path)
    packaged = os.path.realpath(os.path.join(os.path.dirname(spec.origin), "python", "lib", "pyspark.zip"))
    return [entry for entry in path if os.path.realpath(entry) != packaged]


def main() -> None:
    sys.path[:] = without_packaged_zip(sys.path)
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
