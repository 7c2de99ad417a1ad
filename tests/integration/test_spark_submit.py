"""spark-submit of each job with the `make dist` zip produces what `mmpack run` produces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mmpack_udfs import cli, schemas
from mmpack_udfs.io import tables
from tests.conftest import PACKED_DEMO_SETTINGS, set_args
from tests.jvms import submit_env
from tools import make_dist

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"


def submit(job: str, dist: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        **submit_env(),
    }
    job_file = str(ROOT / "jobs" / "mmpack_job.py")
    command = [str(SPARK_SUBMIT), "--master", "local[2]", "--py-files", str(dist), job_file, job]
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)


def table_rows(out: Path, name: str) -> list[dict]:
    rows = tables.read_arrow(schemas.table_uri(str(out), name)).to_pylist()
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def test_spark_submit_jobs_match_mmpack_run(demo, packed_demo, tmp_path):
    """Each stage its own application, against the session's in-process run of the same
    stages and settings (``packed_demo``)."""
    dist = make_dist.build(tmp_path / "dist")
    names = zipfile.ZipFile(dist).namelist()
    assert {"mmpack_udfs/pack/costs.py", "loader/balance.py", "mmpack_udfs/config/model.py"} <= set(names)
    assert not [name for name in names if name.startswith("mmpack_udfs/demo/")]
    by_submit = tmp_path / "submit"
    sets = set_args(PACKED_DEMO_SETTINGS)
    for job in cli.PIPELINE:  # validate as its own application: the Airflow DAG's end-to-end test
        result = submit(job, dist, "--config", str(demo.config), "--out", str(by_submit), *sets)
        assert result.returncode == 0, result.stderr[-3000:]
    assert cli.main(["validate", "--config", str(demo.config), "--out", str(by_submit), *sets]) == 0
    assert json.loads((by_submit / "report" / "validate.json").read_text())["ok"]
    for name in schemas.TABLES:
        assert table_rows(by_submit, name) == table_rows(packed_demo, name)
    outputs = (packed_demo, by_submit)
    manifests = [json.loads((out / "packed" / "manifest.json").read_text()) for out in outputs]
    assert [s["sha256"] for s in manifests[0]["shards"]] == [s["sha256"] for s in manifests[1]["shards"]]
    assert manifests[0]["totals"] == manifests[1]["totals"]


def test_spark_submit_bad_config_exits_2(demo, tmp_path):
    dist = make_dist.build(tmp_path / "dist")
    result = submit("tokenize", dist, "--config", str(demo.config), "--out", str(tmp_path / "out"),
                    "--set", "pack.budget=-1")  # fmt: skip
    assert result.returncode == cli.EXIT_BAD_CONFIG
    assert "pack.budget must be a positive integer" in result.stdout + result.stderr


def test_the_venv_spark_submit_works_by_absolute_path_without_path(demo, tmp_path):
    """cron, an Airflow worker or an IDE call .venv/bin/spark-submit with a bare PATH."""
    dist = make_dist.build(tmp_path / "dist")
    bare = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", **submit_env()}
    job = [
        str(SPARK_SUBMIT),
        "--master",
        "local[1]",
        "--py-files",
        str(dist),
        str(ROOT / "jobs" / "mmpack_job.py"),
        "tokenize",
    ]
    args = ["--config", str(demo.config), "--out", str(tmp_path / "out"), "--set", "pack.budget=-1"]
    result = subprocess.run([*job, *args], env=bare, capture_output=True, text=True, timeout=300)
    assert result.returncode == cli.EXIT_BAD_CONFIG, result.stderr[-3000:]  # the job itself ran
    assert "pack.budget must be a positive integer" in result.stdout + result.stderr
