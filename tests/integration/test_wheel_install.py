"""The package as a platform installs it: the wheel alone in a fresh virtualenv (no source
checkout on the path), and that virtualenv packed by venv-pack running a spark-submit job.
Slow: the `installed` fixture pip-installs the wheel's `spark` extra."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.integration.conftest import clean_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_mmpack_runs_from_the_wheel_without_a_checkout(installed, tmp_path):
    python, mmpack = installed / "bin" / "python", installed / "bin" / "mmpack"
    env = clean_env(tmp_path)
    where = subprocess.run([python, "-c", "import mmpack_udfs; print(mmpack_udfs.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert where.stdout.startswith(str(installed)) and str(ROOT) not in where.stdout
    subprocess.run([mmpack, "demo-data", "in", "--samples", "100"], cwd=tmp_path, env=env, check=True)
    command = [mmpack, "run", "--config", "in/mmpack.yaml", "--out", "out", "--master", "local[2]"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "packed" / "manifest.json").read_text())
    assert manifest["totals"]["bins"] > 0 and (tmp_path / "out" / "report" / "lengths.png").stat().st_size


def test_the_venv_pack_archive_runs_a_spark_submit_job(env_archive, tmp_path):
    """Spark's local mode unpacks `--archives` into its SparkFiles folder, not the working
    directory, so `./environment/bin/python` does not exist there (YARN and Kubernetes
    unpack it in each container's working directory): the archive is unpacked here as a
    container would, and every Python of the job is the unpacked one."""
    environment = tmp_path / "environment"
    with tarfile.open(env_archive) as tar:
        tar.extractall(environment, filter="fully_trusted")  # venv-pack's own links stay as they are
    python = environment / "bin" / "python"
    env = {**clean_env(tmp_path), "PYSPARK_PYTHON": str(python)}
    demo = [python, "-m", "mmpack_udfs.cli", "demo-data", "in", "--samples", "60"]
    subprocess.run(demo, cwd=tmp_path, env=env, check=True)
    command = [environment / "bin" / "spark-submit", "--master", "local[2]",
               "--conf", f"spark.pyspark.python={python}", str(ROOT / "jobs" / "mmpack_job.py"),
               "normalize", "--config", "in/mmpack.yaml", "--out", str(tmp_path / "out")]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "out" / "tables" / "samples" / "_delta_log").is_dir()
    assert "reconciled: read" in run.stdout
