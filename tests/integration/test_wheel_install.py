"""The package as a platform installs it: the wheel alone in a fresh virtualenv (no source
checkout on the path). That virtualenv packed by venv-pack runs every stage under spark-submit
on a standalone cluster in test_standalone_cluster.py.
Slow: the `installed` fixture pip-installs the wheel's `spark` extra."""

from __future__ import annotations

import json
import subprocess
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
