"""mmpack on Airflow 3: normalize → tokenize → pack → validate-shards, each one spark-submit;
then, when the ``energon`` param names a destination, export-energon (``mmpack export energon``:
the validated pack as a Megatron-Energon dataset).

Trigger it with the params below (UI, ``airflow dags trigger mmpack --conf '{...}'``, or an
upstream DAG). When validate-shards succeeds it emits an event on ``MANIFEST_ASSET`` whose
``extra`` says where the validated manifest is, so a training DAG can be scheduled on it:

    from airflow.sdk import Asset, dag, task
    MANIFEST_ASSET = Asset(name="mmpack_packed_manifest", uri="x-mmpack://packed-manifest")

    @dag(schedule=[MANIFEST_ASSET])
    def train():
        @task
        def manifest(*, triggering_asset_events):
            return triggering_asset_events[MANIFEST_ASSET][-1].extra["manifest"]

Every stage is idempotent (a run id derived from its input; a stage already committed or
published does nothing), so a retried task finishes the work instead of repeating it.

Deployment settings, read from the environment when the DAG is parsed:

    MMPACK_HOME           the mmpack checkout with jobs/ and dist/mmpack_udfs.zip (`make dist`);
                          default: the checkout holding this file
    MMPACK_SPARK_CONN_ID  the Airflow Spark connection (master, deploy mode, queue);
                          default: spark_default
    MMPACK_PYTHON         the Python of the Spark driver and executors (spark.pyspark.python):
                          an interpreter with mmpack's dependencies, e.g.
                          ./environment/bin/python with MMPACK_ARCHIVES; default: Spark's
    MMPACK_ARCHIVES       spark-submit --archives, e.g. s3://bucket/pyenv.tar.gz#environment
                          (a venv-pack archive; see the README); default: none
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, Asset, Param
from airflow.sdk.exceptions import AirflowSkipException

MMPACK_HOME = Path(os.environ.get("MMPACK_HOME") or Path(__file__).resolve().parents[2])
SPARK_CONN_ID = os.environ.get("MMPACK_SPARK_CONN_ID", "spark_default")
SPARK_PYTHON = os.environ.get("MMPACK_PYTHON")
SPARK_ARCHIVES = os.environ.get("MMPACK_ARCHIVES")


def load_pipeline(home: Path) -> ModuleType:
    """mmpack's stage list (mmpack_udfs/pipeline.py, standard library only), read from the
    checkout by path: the Airflow environment does not install mmpack."""
    spec = importlib.util.spec_from_file_location("mmpack_stages", home / "mmpack_udfs" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


PIPELINE = load_pipeline(MMPACK_HOME)
MANIFEST_ASSET = Asset(name="mmpack_packed_manifest", uri="x-mmpack://packed-manifest")
PACKED_MANIFEST = "packed/manifest.json"  # under the output root (mmpack_udfs.schemas.manifest_uri)

ABSOLUTE = r"^(/|s3a?://|s3n://)"  # workers may run anywhere: no relative paths
PARAMS = {
    "input": Param(
        type="string",
        pattern=ABSOLUTE,
        description="mmpack YAML config naming the datasets (an absolute path on the workers)",
    ),
    "output": Param(
        type="string",
        pattern=ABSOLUTE,
        description="output root: tables/, packed/ (shards + manifest.json) and report/ go under it",
    ),
    "profile": Param(
        "qwen2_vl",
        enum=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "internvl_chat"],
        description="model profile",
    ),
    "energon": Param(
        "",
        type="string",
        pattern=r"^$|" + ABSOLUTE,
        description="export the validated pack there as a Megatron-Energon dataset (an empty or new "
        "folder, absolute or s3://); empty: no export",
    ),
    "budget": Param(
        16384,
        type="integer",
        minimum=64,
        description="token budget: the longest sample (tokenize.max_tokens) and the bin size (pack.budget)",
    ),
}
STAGE_ARGS = [
    "--config", "{{ params.input }}",
    "--out", "{{ params.output }}",
    "--set", "tokenize.profile={{ params.profile }}",
    "--set", "tokenize.max_tokens={{ params.budget }}",
    "--set", "pack.budget={{ params.budget }}",
]  # fmt: skip
TASK_IDS = {"validate": "validate-shards", "export": "export-energon"}  # where not the stage's name
TIMEOUTS = {  # per attempt, by stage; a stage that runs longer is killed and retried
    "normalize": timedelta(hours=6),
    "tokenize": timedelta(hours=8),
    "pack": timedelta(hours=4),
    "validate": timedelta(hours=2),
    "export": timedelta(hours=4),
}
DEFAULT_ARGS = {
    "owner": "mmpack",
    "retries": 2,
    "retry_delay": timedelta(minutes=5),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=30),
}


def manifest_location(output: str) -> str:
    """Where the manifest of an output root is."""
    return f"{output.rstrip('/')}/{PACKED_MANIFEST}"


class ValidateShardsOperator(SparkSubmitOperator):
    """spark-submit jobs/mmpack_job.py validate; on success, an event on MANIFEST_ASSET naming it."""

    def execute(self, context: Any) -> None:
        super().execute(context)
        params = context["params"]
        context["outlet_events"][MANIFEST_ASSET].extra.update(
            manifest=manifest_location(params["output"]),
            output=params["output"],
            profile=params["profile"],
            budget=params["budget"],
            dag_run_id=context["run_id"],
        )


class ExportEnergonOperator(SparkSubmitOperator):
    """spark-submit jobs/mmpack_job.py export energon --to {{ params.energon }}; skipped when
    the param is empty."""

    def execute(self, context: Any) -> None:
        if not context["params"]["energon"]:
            raise AirflowSkipException("no energon destination given: nothing to export")
        super().execute(context)


def spark_stage(stage: str, operator: type[SparkSubmitOperator] = SparkSubmitOperator, args=(), **kw):
    """One pipeline stage as a spark-submit of jobs/mmpack_job.py <stage> with the executor zip."""
    return operator(
        task_id=TASK_IDS.get(stage, stage),
        conn_id=SPARK_CONN_ID,
        application=str(MMPACK_HOME / "jobs" / "mmpack_job.py"),
        py_files=str(MMPACK_HOME / "dist" / "mmpack_udfs.zip"),
        archives=SPARK_ARCHIVES,
        conf={"spark.pyspark.python": SPARK_PYTHON} if SPARK_PYTHON else None,
        name=f"mmpack-{stage}",
        application_args=[stage, *args, *STAGE_ARGS],
        execution_timeout=TIMEOUTS[stage],
        **kw,
    )


with DAG(
    dag_id="mmpack",
    description="multimodal SFT data → Delta tables → validated packed shards + manifest",
    schedule=None,
    catchup=False,
    max_active_runs=1,  # two runs into one output root would race on its tables
    dagrun_timeout=timedelta(hours=24),
    default_args=DEFAULT_ARGS,
    params=PARAMS,
    tags=["mmpack", "spark", "training-data"],
    doc_md=__doc__,
) as dag:
    tasks = [  # normalize → tokenize → pack → validate, in the order mmpack declares them
        spark_stage(s.name, ValidateShardsOperator, outlets=[MANIFEST_ASSET])
        if s.name == "validate"
        else spark_stage(s.name)
        for s in PIPELINE.STAGES
    ]
    tasks.append(
        spark_stage("export", ExportEnergonOperator, args=["energon", "--to", "{{ params.energon }}"])
    )
    for before, after in itertools.pairwise(tasks):
        before >> after
