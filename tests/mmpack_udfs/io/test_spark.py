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


def test_a_local_jvm_gets_a_quarter_of_the_machine_unless_the_config_says(monkeypatch):
    import os

    from mmpack_udfs.io.spark import DRIVER_MEMORY

    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert session_settings(SparkConfig())[DRIVER_MEMORY] == f"{min(max(total >> 32, 1), 16)}g"
    given = SparkConfig(conf={DRIVER_MEMORY: "3g"})
    assert session_settings(given)[DRIVER_MEMORY] == "3g"
    assert DRIVER_MEMORY not in session_settings(SparkConfig(master="spark://host:7077"))


def test_an_embedded_local_run_has_no_web_ui_unless_the_config_asks(monkeypatch):
    from mmpack_udfs.io.spark import UI_ENABLED

    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert session_settings(SparkConfig())[UI_ENABLED] == "false"
    assert session_settings(SparkConfig(conf={UI_ENABLED: True}))[UI_ENABLED] == "true"
    assert UI_ENABLED not in session_settings(SparkConfig(master="spark://host:7077"))
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    assert UI_ENABLED not in session_settings(SparkConfig())  # spark-submit's


def test_an_embedded_local_run_starts_the_daemon_that_skips_pyspark_zip(monkeypatch):
    from mmpack_udfs.io.spark import DAEMON_MODULE

    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert session_settings(SparkConfig())[DAEMON_MODULE] == "mmpack_udfs.io.worker_daemon"
    own = SparkConfig(conf={DAEMON_MODULE: "pyspark.daemon"})
    assert session_settings(own)[DAEMON_MODULE] == "pyspark.daemon"
    assert DAEMON_MODULE not in session_settings(SparkConfig(master="spark://host:7077"))
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    assert DAEMON_MODULE not in session_settings(SparkConfig())  # spark-submit's


def test_spark_submit_keeps_its_own_master(monkeypatch):
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    settings = session_settings(SparkConfig(), master=None)
    assert "spark.master" not in settings and "spark.pyspark.python" not in settings
    assert "spark.driver.memory" not in settings  # the cluster's


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


def test_quiet_logging_is_the_default_and_verbose_gives_spark_its_own(monkeypatch):
    from mmpack_udfs.io.spark import DRIVER_JAVA_OPTIONS, QUIET_LOG4J, log_level

    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert QUIET_LOG4J.is_file()  # shipped with the package (pyproject package-data)
    given = SparkConfig(conf={DRIVER_JAVA_OPTIONS: "-Xss4m"})
    options = session_settings(given)[DRIVER_JAVA_OPTIONS]
    assert options.startswith("-Xss4m ") and f"-Dlog4j2.configurationFile={QUIET_LOG4J.as_uri()}" in options
    assert session_settings(given, verbose=True)[DRIVER_JAVA_OPTIONS] == "-Xss4m"
    assert (log_level(SparkConfig(), False), log_level(SparkConfig(), True)) == ("ERROR", "WARN")
    assert log_level(SparkConfig(log_level="INFO"), True) == "INFO"


def test_the_embedded_jvm_compiles_quickly_when_asked(monkeypatch):
    from mmpack_udfs.io.spark import DRIVER_JAVA_OPTIONS, QUICK_JIT

    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert QUICK_JIT not in session_settings(SparkConfig())[DRIVER_JAVA_OPTIONS]  # input size unknown
    # null (the default): by the size of the run's input files
    assert QUICK_JIT in session_settings(SparkConfig(), input_bytes=10 << 20)[DRIVER_JAVA_OPTIONS]
    assert QUICK_JIT not in session_settings(SparkConfig(), input_bytes=1 << 30)[DRIVER_JAVA_OPTIONS]
    assert QUICK_JIT not in session_settings(SparkConfig(quick_jit=False), input_bytes=1)[DRIVER_JAVA_OPTIONS]
    given = SparkConfig(quick_jit=True, conf={DRIVER_JAVA_OPTIONS: "-XX:TieredStopAtLevel=4"})
    # the user's own option comes after ours, so HotSpot takes theirs
    assert session_settings(given)[DRIVER_JAVA_OPTIONS].startswith(f"{QUICK_JIT} -XX:TieredStopAtLevel=4 ")
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")  # spark-submit started the JVM already
    assert DRIVER_JAVA_OPTIONS not in session_settings(SparkConfig(quick_jit=True))


@pytest.mark.spark
def test_the_running_jvm_got_the_quick_jit_option(spark):  # the tests' session asks for it
    from mmpack_udfs.io.spark import QUICK_JIT

    runtime = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    assert QUICK_JIT in list(runtime.getInputArguments())


def test_the_jvm_stderr_filter_drops_its_start_up_lines_and_keeps_the_rest(tmp_path):
    import io

    from mmpack_udfs.io.spark import forward_stderr

    jvm = b"WARNING: Using incubator modules: jdk.incubator.vector\nTraceback: a real error\n"
    with open(tmp_path / "err", "wb") as sink:
        forward_stderr(io.BytesIO(jvm), sink.fileno())
    assert (tmp_path / "err").read_bytes() == b"Traceback: a real error\n"
