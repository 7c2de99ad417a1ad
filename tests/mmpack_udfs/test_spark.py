import sys

from mmpack_udfs.spark import session_settings


def test_embedded_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    settings = session_settings({"conf": {"spark.ui.enabled": False, "spark.sql.shuffle.partitions": 8}})
    assert settings["spark.master"] == "local[*]"
    assert settings["spark.pyspark.python"] == sys.executable
    assert settings["spark.executorEnv.TOKENIZERS_PARALLELISM"] == "false"
    assert settings["spark.ui.enabled"] == "false" and settings["spark.sql.shuffle.partitions"] == "8"
    assert session_settings({"master": "local[1]"}, master="yarn")["spark.master"] == "yarn"


def test_spark_submit_keeps_its_own_master(monkeypatch):
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    settings = session_settings({"master": "local[*]"}, master=None)
    assert "spark.master" not in settings and "spark.pyspark.python" not in settings
