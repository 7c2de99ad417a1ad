"""An Airflow home of its own (SQLite, no examples) and a Spark connection to local[2].

Set before Airflow is imported: Airflow reads its configuration once, at import. The Spark
side (spark-submit, the jobs' Python) comes from the project's virtualenv, MMPACK_VENV
(default: .venv of this checkout), exactly as a deployment points MMPACK_PYTHON at one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT_VENV = Path(os.environ.get("MMPACK_VENV") or REPO / ".venv").resolve()
AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="mmpack-airflow-"))

os.environ.update(
    AIRFLOW_HOME=str(AIRFLOW_HOME),
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "airflow" / "dags"),
    AIRFLOW__LOGGING__LOGGING_LEVEL="WARNING",
    AIRFLOW_CONN_MMPACK_SPARK='{"conn_type": "spark", "host": "local[2]"}',
    MMPACK_SPARK_CONN_ID="mmpack_spark",
    MMPACK_HOME=str(REPO),
    MMPACK_PYTHON=str(PROJECT_VENV / "bin" / "python"),
    PATH=f"{PROJECT_VENV / 'bin'}{os.pathsep}{os.environ['PATH']}",  # spark-submit
)
# The test machine's tuning of spark-submit's JVMs (quick compiler, class archive: tests/jvms.py);
# the DAG's commands stay a deployment's.
_jvms = subprocess.run([str(PROJECT_VENV / "bin" / "python"), "-m", "tests.jvms"],
                       cwd=REPO, check=True, capture_output=True, text=True)  # fmt: skip
os.environ.update(line.split("=", 1) for line in _jvms.stdout.splitlines())


@pytest.fixture(scope="session")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "airflow" / "dags"))


@pytest.fixture(scope="session")
def dag(dagbag):
    return dagbag.dags["mmpack"]


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated metadata database (what `dag.test()` records its run in)."""
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)


def project(*args: str) -> None:
    """Run a command of the project's virtualenv (its Python has pyspark, deltalake, ...)."""
    subprocess.run(
        [str(PROJECT_VENV / "bin" / args[0]), *args[1:]], check=True, cwd=REPO, capture_output=True
    )
