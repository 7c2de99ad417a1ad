"""The class archive: named by the JDK and Spark's jars, mapped by a fresh embedded JVM, and
skipped silently where it does not fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmpack_udfs.config.model import SparkConfig
from mmpack_udfs.io import class_archive
from mmpack_udfs.io.spark import DRIVER_JAVA_OPTIONS, session_settings


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """A JDK home and a jars folder of this test's own, and an empty cache."""
    home, jars = tmp_path / "jdk", tmp_path / "jars"
    home.mkdir()
    jars.mkdir()
    (home / "release").write_text('JAVA_VERSION="17.0.15"\n')
    (jars / "spark-core.jar").write_bytes(b"core")
    monkeypatch.setenv("JAVA_HOME", str(home))
    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(class_archive.DUMP_ENV, raising=False)
    monkeypatch.setattr(class_archive, "spark_jars", lambda: jars)
    return home, jars


def test_the_archive_is_named_by_the_jdk_and_the_jars(fake_install):
    home, jars = fake_install
    first = class_archive.archive_path()
    assert first.parent == Path(os.environ["MMPACK_CACHE"]) / "jvm" and first.suffix == ".jsa"
    assert class_archive.archive_path() == first
    (jars / "delta.jar").write_bytes(b"another jar")
    second = class_archive.archive_path()
    (home / "release").write_text('JAVA_VERSION="21.0.1"\n')
    assert len({first, second, class_archive.archive_path()}) == 3


def test_options_map_the_archive_where_it_exists_and_dump_only_for_the_build(fake_install, monkeypatch):
    assert class_archive.java_options() == []  # none built: the JVM starts as before
    archive = class_archive.archive_path()
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"an archive")
    assert class_archive.java_options() == [f"-XX:SharedArchiveFile={archive}", *class_archive.QUIET]
    monkeypatch.setenv(class_archive.DUMP_ENV, "/tmp/partial.jsa")
    assert class_archive.java_options()[0] == "-XX:ArchiveClassesAtExit=/tmp/partial.jsa"


def test_the_archive_options_come_before_the_users_own(monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    given = SparkConfig(conf={DRIVER_JAVA_OPTIONS: "-XX:SharedArchiveFile=/mine.jsa"})
    options = session_settings(given, java_options=["-XX:SharedArchiveFile=/ours.jsa"])[DRIVER_JAVA_OPTIONS]
    assert options.index("/ours.jsa") < options.index("/mine.jsa")  # HotSpot takes the last


# A fresh embedded session (its own JVM) in a process of its own, logging where each class came from.
FRESH_SESSION = """
import sys
from mmpack_udfs.config.model import SparkConfig
from mmpack_udfs.io.spark import get_spark
options = "-Xlog:class+load=info:file=" + sys.argv[1]
spark = get_spark(SparkConfig(conf={"spark.driver.extraJavaOptions": options}), master="local[1]")
print(spark.range(5).count())
"""


def fresh_session(tmp_path: Path, cache: Path) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / f"classes-{cache.name}.log"
    env = {**os.environ, "MMPACK_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", FRESH_SESSION, str(log)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "5", done.stderr[-3000:]
    return done, log.read_text()


SPARK_CONTEXT_SHARED = "org.apache.spark.SparkContext source: shared objects file (top)"


@pytest.mark.spark
@pytest.mark.families  # no fixture of either lane: in the one with time to spare (Makefile)
def test_a_fresh_session_maps_sparks_classes_and_a_broken_archive_is_skipped_silently(tmp_path):
    archive = class_archive.build()  # made by `make setup`; built here where it is missing
    assert archive is not None and archive.is_file()
    _, loaded = fresh_session(tmp_path, archive.parent.parent)
    assert SPARK_CONTEXT_SHARED in loaded  # from the archive, not Spark's jar
    broken = tmp_path / "broken-cache"
    (broken / "jvm").mkdir(parents=True)
    (broken / "jvm" / archive.name).write_bytes(b"half an archive")
    done, loaded = fresh_session(tmp_path, broken)
    assert SPARK_CONTEXT_SHARED not in loaded and "org.apache.spark.SparkContext source: " in loaded
    assert done.stderr == ""  # no line about the archive: the session starts as it did without one
