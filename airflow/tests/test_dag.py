"""The mmpack DAG: it imports, its graph and params are as documented, and it runs end to end."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os

import pytest
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import Asset
from conftest import REPO, project

STAGES = {
    "normalize": "normalize",
    "tokenize": "tokenize",
    "pack": "pack",
    "validate-shards": "validate",
    "export-energon": "export",
}
MANIFEST_ASSET = Asset(name="mmpack_packed_manifest", uri="x-mmpack://packed-manifest")


def test_the_dag_folder_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert list(dagbag.dags) == ["mmpack"]


def test_tasks_run_in_order_each_a_spark_submit_of_its_job(dag):
    order = list(STAGES)
    assert sorted(t.task_id for t in dag.tasks) == sorted(order)
    for before, after in itertools.pairwise(order):
        assert dag.get_task(after).upstream_task_ids == {before}
    for task_id, job in STAGES.items():
        task = dag.get_task(task_id)
        assert isinstance(task, SparkSubmitOperator)
        assert task.application == str(REPO / "jobs" / "mmpack_job.py")
        assert task.application_args[0] == job
        assert task.py_files == str(REPO / "dist" / "mmpack_udfs.zip")
        assert task._conn_id == "mmpack_spark"
        assert task.conf == {"spark.pyspark.python": os.environ["MMPACK_PYTHON"]}


def test_params_are_input_output_profile_budget_and_energon(dag):
    assert set(dag.params) == {"input", "output", "profile", "budget", "energon"}
    assert dag.params.get_param("energon").value == ""
    assert dag.params.get_param("profile").value == "qwen2_vl"
    assert dag.params.get_param("budget").value == 16384
    args = " ".join(dag.get_task("tokenize").application_args)
    for expected in (
        "--config {{ params.input }}",
        "--out {{ params.output }}",
        "--set tokenize.profile={{ params.profile }}",
        "--set pack.budget={{ params.budget }}",
    ):
        assert expected in args


@pytest.mark.parametrize(
    "conf",
    [
        {"budget": 10},
        {"budget": "big"},
        {"profile": "llama"},
        {"output": "relative/out"},
        {"energon": "relative/energon"},
    ],
)
def test_bad_params_are_rejected(dag, conf):
    from airflow.sdk.exceptions import ParamValidationError

    params = copy.deepcopy(dag.params)
    params.update({"input": "/in/mmpack.yaml", "output": "s3://bucket/run1"})
    assert params.validate()["budget"] == 16384
    with pytest.raises(ParamValidationError):
        params.update(conf)


def test_retries_timeouts_and_the_manifest_asset(dag):
    assert dag.max_active_runs == 1 and dag.dagrun_timeout is not None
    for task in dag.tasks:
        assert task.retries >= 1 and task.execution_timeout is not None
    assert dag.get_task("validate-shards").outlets == [MANIFEST_ASSET]
    assert all(not t.outlets for t in dag.tasks if t.task_id != "validate-shards")


def test_the_energon_export_runs_after_validation_and_only_when_asked(dag):
    from airflow.sdk.exceptions import AirflowSkipException

    task = dag.get_task("export-energon")
    assert task.application_args[:4] == ["export", "energon", "--to", "{{ params.energon }}"]
    with pytest.raises(AirflowSkipException, match="nothing to export"):
        task.execute({"params": {"energon": ""}})


@pytest.mark.slow
def test_the_dag_runs_end_to_end_with_spark_submit(dag, airflow_db, tmp_path):
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from sqlalchemy import select

    project("python", "tools/make_dist.py", "dist")  # the zip the DAG ships with --py-files
    project("mmpack", "demo-data", str(tmp_path / "input"), "--samples", "40", "--seed", "1")
    out = tmp_path / "out"
    energon = tmp_path / "energon"
    conf = {"input": str(tmp_path / "input" / "mmpack.yaml"), "output": str(out), "budget": 4096,
            "energon": str(energon)}  # fmt: skip

    run = dag.test(run_conf=conf)

    assert run.state == "success"
    assert {ti.task_id: ti.state for ti in run.get_task_instances()} == dict.fromkeys(STAGES, "success")
    manifest = json.loads((out / "packed" / "manifest.json").read_text())
    assert manifest["format"] == "mmpack-packed" and manifest["budget"] == 4096
    assert manifest["profile"] == "qwen2_vl" and manifest["config"]["tokenize"]["max_tokens"] == 4096
    assert manifest["totals"]["samples"] > 0 and manifest["totals"]["fill"] > 0.5
    for shard in manifest["shards"]:
        data = (out / "packed" / shard["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (shard["bytes"], shard["sha256"])
    validated = json.loads((out / "report" / "validate.json").read_text())
    assert validated["ok"] and validated["source"]["checked"]
    assert validated["run_id"] == manifest["run_id"]
    with create_session() as session:
        query = select(AssetEvent).where(AssetEvent.source_run_id == run.run_id)
        events = [(e.asset.name, e.source_task_id, e.extra) for e in session.scalars(query)]
    assert [e[:2] for e in events] == [(MANIFEST_ASSET.name, "validate-shards")]
    assert events[0][2]["manifest"] == str(out / "packed" / "manifest.json")
    assert events[0][2]["budget"] == 4096
    exported = json.loads((energon / "mmpack_export.json").read_text())
    assert exported["source"]["packs"]["train"]["run_id"] == manifest["run_id"]
    assert exported["splits"]["train"]["bins"] == manifest["totals"]["bins"]
    assert (energon / ".nv-meta" / "index.sqlite").exists()
