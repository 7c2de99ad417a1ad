"""What a user sees from `mmpack run` in a pipe (CI, Airflow): its own lines only, with
live progress per stage, and Spark's logging back with --verbose. Real JVMs, subprocesses."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mmpack_udfs.demo import data as demo_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> demo_data.DemoData:
    """A demo of 20 samples: what is printed does not depend on how many."""
    return demo_data.generate(tmp_path_factory.mktemp("cli-demo"), samples=20, seed=7)


JVM_OR_LOG4J = re.compile(
    r"log4j|WARNING: |Setting default log level|NativeCodeLoader|SparkUI"
    r"|^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (WARN|INFO)"
)
PROGRESS = re.compile(r"^(normalize|tokenize|pack|validate): (\d+)/(\d+) tasks")


def mmpack(*args: str, cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mmpack_udfs.cli", *args, "--master", "local[2]"]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_run_prints_no_jvm_line_and_shows_progress_per_stage(demo, tmp_path):
    run = mmpack("run", "--config", str(demo.config), "--out", str(tmp_path / "out"),
                 "--set", "spark.progress_seconds=0.2", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "pipeline done" in run.stdout
    noise = [line for line in run.stderr.splitlines() if JVM_OR_LOG4J.search(line)]
    assert noise == []
    lines = run.stderr.splitlines()
    progress = [PROGRESS.match(line) for line in lines if not line.startswith("mmpack: ")]
    assert all(progress), run.stderr  # nothing else on stderr than progress and mmpack's log
    assert "mmpack: [2/3] tokenize ..." in run.stderr
    last = {m[1]: (int(m[2]), int(m[3])) for m in progress}
    assert set(last) == {"normalize", "tokenize", "pack"}
    assert all(done == total > 0 for done, total in last.values())


def test_verbose_brings_sparks_own_lines_back(demo, tmp_path):
    run = mmpack("normalize", "--config", str(demo.config), "--out", str(tmp_path / "out"),
                 "--set", "spark.progress_seconds=0", "--verbose", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert any(JVM_OR_LOG4J.search(line) for line in run.stderr.splitlines())
