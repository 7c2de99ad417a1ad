"""The job whose classes go into the class archive (``class_archive.build`` runs this module in a
process of its own, with ``MMPACK_CLASS_ARCHIVE_DUMP`` set: its JVM writes the archive as it exits)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import SparkContext
from pyspark.sql import Window
from pyspark.sql import functions as F

from mmpack_udfs.config.model import SparkConfig
from mmpack_udfs.io.spark import get_spark


def run(work: Path) -> None:
    """A local session runs a job through the paths mmpack's stages take (Arrow in and out of
    Python workers, a shuffle, a sort, a window, a broadcast join, Parquet), then its JVM exits,
    writing the archive."""
    spark = get_spark(SparkConfig(), master="local[2]")

    def double(batches):
        for batch in batches:
            columns = [batch.column(0), pc.multiply(batch.column(1), 2.0)]
            yield pa.RecordBatch.from_arrays(columns, schema=batch.schema)

    frame = spark.range(2000, numPartitions=4).withColumn("y", F.rand(0))
    frame = frame.mapInArrow(double, frame.schema).withColumn("k", F.col("id") % 7)
    ranked = frame.withColumn("r", F.row_number().over(Window.partitionBy("k").orderBy("y")))
    joined = ranked.join(F.broadcast(frame.groupBy("k").agg(F.sum("y").alias("s"))), "k")
    joined.orderBy("y").write.parquet(str(work / "t"))
    spark.read.parquet(str(work / "t")).toArrow()
    jvm = SparkContext._gateway.proc
    spark.stop()
    jvm.stdin.close()  # the gateway exits on EOF (System.exit): the archive is written then
    jvm.wait(timeout=600)


if __name__ == "__main__":
    run(Path(sys.argv[1]))
