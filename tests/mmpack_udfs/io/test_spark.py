import sys

import pyarrow as pa
import pytest

from mmpack_udfs.config.model import SparkConfig
from mmpack_udfs.io.spark import one_task_per_row, session_settings


def test_embedded_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    settings = session_settings(
        SparkConfig(conf={"spark.ui.enabled": False, "spark.sql.shuffle.partitions": 8})
    )
    assert settings["spark.master"] == "local[*]"
    assert settings["spark.pyspark.python"] == sys.executable
    assert settings["spark.executorEnv.TOKENIZERS_PARALLELISM"] == "false"
    assert settings["spark.ui.enabled"] == "false" and settings["spark.sql.shuffle.partitions"] == "8"
    assert session_settings(SparkConfig(master="local[1]"), master="yarn")["spark.master"] == "yarn"


def test_spark_submit_keeps_its_own_master(monkeypatch):
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    settings = session_settings(SparkConfig(), master=None)
    assert "spark.master" not in settings and "spark.pyspark.python" not in settings


@pytest.mark.spark
@pytest.mark.parametrize("items", [0, 1, 7, 40])
def test_one_task_per_row_gives_every_item_its_own_task(spark, items):
    table = pa.table(
        {
            "index": pa.array(range(items), pa.int32()),
            "uri": pa.array([f"s3://b/{i}" for i in range(items)], pa.string()),
        }
    )
    tasks = one_task_per_row(spark, table).rdd.glom()
    per_task = tasks.map(lambda rows: [r["index"] for r in rows]).collect()
    assert [i for task in per_task for i in task] == list(range(items))
    assert all(len(task) == 1 for task in per_task) if items else per_task in ([], [[]])
