"""mmpack on a real multi-process Spark cluster (a standalone master and two workers on
loopback): what local mode cannot show. Executors run in their workers' directories, not the
driver's; the README's spark-submit recipe ships the venv-pack archive to them; an s3://
model directory is fetched by each executor; an executor killed mid-tokenize is replaced, its
tasks retried, and the shards are still byte-identical to a local[2] run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from mmpack_udfs import cli
from mmpack_udfs.demo import data as demo_data
from tests.conftest import PACKED_DEMO_SETTINGS, set_args
from tests.integration.conftest import clean_env
from tests.integration.standalone import ExecutorKiller, free_port, start_cluster
from tests.jvms import submit_env
from tests.models.build import build_model_dir

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "mmpack_job.py"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("standalone"))
    yield cluster
    cluster.stop()
    cluster.remove_unpacked_archives()


def manifest(out: Path) -> dict:
    return json.loads((out / "packed" / "manifest.json").read_text())


def assert_same_shards(out: Path, reference: Path) -> None:
    ours, theirs = manifest(out), manifest(reference)
    assert [s["sha256"] for s in ours["shards"]] == [s["sha256"] for s in theirs["shards"]]
    assert ours["totals"] == theirs["totals"]


def test_an_executor_killed_mid_tokenize_still_gives_identical_shards(cluster, s3_bucket, tmp_path):
    """Demo data large enough for tokenize tasks of several seconds. Also: the model
    directory is an s3:// prefix, and the driver's copy lies under a relative cache path that
    does not exist in an executor's working directory, so each executor fetches its own."""
    endpoint, bucket = s3_bucket
    demo = demo_data.generate(tmp_path / "demo", samples=1000, seed=3)
    model = build_model_dir("qwen2_5_vl", tmp_path / "model")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for file in model.iterdir():
        client.upload_file(str(file), bucket, f"models/qwen2_5_vl/{file.name}")
    # 4 tokenize tasks: a kill that lands as its task ends can try the next one
    settings = [f"tokenize.model=s3://{bucket}/models/qwen2_5_vl", f"s3.endpoint_override={endpoint}",
                "tokenize.rows_per_file=250", *PACKED_DEMO_SETTINGS]  # fmt: skip
    sets = set_args(settings)
    local = tmp_path / "local"
    reference = ["run", "--config", str(demo.config), "--out", str(local), "--master", "local[2]"]
    assert cli.main([*reference, *sets]) == 0

    driver, executor_cache, ui_port = tmp_path / "driver", tmp_path / "executor-cache", free_port()
    driver.mkdir()
    command = [sys.executable, "-m", "mmpack_udfs.cli", "run", "--config", str(demo.config),
               "--out", str(tmp_path / "cluster"), "--master", cluster.url, *sets,
               "--set", f"spark.conf.spark.ui.port={ui_port}",
               "--set", f"spark.conf.spark.executorEnv.MMPACK_CACHE={executor_cache}"]  # fmt: skip
    killer = ExecutorKiller(ui_port, "tokenize")
    killer.start()
    env = {**os.environ, "MMPACK_CACHE": "driver-cache", **submit_env()}  # cache: in the driver's dir
    run = subprocess.run(command, cwd=driver, env=env, capture_output=True, text=True, timeout=900)
    killer.done.set()
    killer.join()
    assert run.returncode == 0, run.stderr[-3000:]
    assert killer.killed is not None, f"no kill failed a tokenize task ({killer.lost_races} lost the race)"
    assert "failed attempts (retried)" in run.stderr, run.stderr  # mmpack progress saw the retry
    assert_same_shards(tmp_path / "cluster", local)

    assert list((driver / "driver-cache" / "models").glob("*/tokenizer.json"))
    assert list((executor_cache / "models").glob("*/tokenizer.json"))  # fetched by an executor
    executors = cluster.executor_dirs()
    assert {d.parents[1] for d in executors} == set(cluster.work_dirs)  # both workers ran executors
    assert not any(d.is_relative_to(driver) for d in executors)


def test_the_readme_spark_submit_recipe_with_the_venv_pack_archive(
    cluster, installed, env_archive, demo, packed_demo, tmp_path
):
    """README "On a cluster": ``run`` (normalize, tokenize and pack in one application)
    submitted with ``--archives mmpack-env.tar.gz#environment`` and
    ``spark.pyspark.python=./environment/bin/python`` from a shell whose only virtualenv is
    the one packed, at ``./environment`` in the driver's directory as on an edge node (a link
    to it: unpacking 1.7 GB once more would show nothing new), then ``validate`` on what it
    wrote. Spark unpacks the archive for the driver, and each of the two executors (one per
    worker) unpacks it in its own directory. (One application per stage, as the README lists
    them: tests/integration/test_spark_submit.py.)"""
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    (submit_dir / "environment").symlink_to(installed, target_is_directory=True)
    sets = set_args(PACKED_DEMO_SETTINGS)
    shell = clean_env(tmp_path)
    shell["PATH"] = f"{submit_dir / 'environment' / 'bin'}:{shell['PATH']}"  # the packed env, activated
    out = tmp_path / "out"
    command = ["environment/bin/spark-submit", "--master", cluster.url, "--total-executor-cores", "2",
               "--archives", f"{env_archive}#environment",
               "--conf", "spark.pyspark.python=./environment/bin/python",
               str(JOB), "run", "--config", str(demo.config), "--out", str(out), *sets]  # fmt: skip
    run = subprocess.run(command, cwd=submit_dir, env=shell, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert cli.main(["validate", "--config", str(demo.config), "--out", str(out), *sets]) == 0
    assert json.loads((out / "report" / "validate.json").read_text())["ok"]
    assert_same_shards(out, packed_demo)
    unpacked = [d for d in cluster.executor_dirs() if (d / "environment" / "bin" / "python").exists()]
    assert len(unpacked) == 2 and {d.parents[1] for d in unpacked} == set(cluster.work_dirs)  # one per worker
