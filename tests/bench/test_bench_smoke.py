"""Every benchmark in bench/ runs in its smoke mode (tiny sizes, seconds): a benchmark that
breaks (an API it calls changed, a flag went missing) fails the suite instead of rotting
until someone needs its figures. The figures of a smoke run mean nothing; bench/RESULTS.md
holds the real ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HEAP_MALLOC
from tests.jvms import submit_env

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted([p.name for p in (ROOT / "bench").glob("bench_*.py")] + ["gpu_check.py"])
RUNNER = Path(__file__).with_name("smoke_runner.py")
TIMEOUT_S = 1500

# pytest-timeout above the runner's own TIMEOUT_S, which names the script it stopped in
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 300)]


def run_order(scripts: list[str]) -> list[str]:
    """bench_pack_spark first (bench_loader reads the text shards it writes; absent, it would
    start a JVM of its own to write them); bench_energon last (it stops the Spark session to
    time its loaders alone, and the next benchmark would start a JVM again)."""
    first, last = ["bench_pack_spark.py"], ["bench_energon.py"]
    return [*first, *(s for s in scripts if s not in first + last), *last]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    """Every benchmark's smoke run, one after the other in one process (``smoke_runner``): each
    script's outcome, and the runner's own."""
    out = tmp_path_factory.mktemp("bench-out")
    results = out / "smoke-results.json"
    # the JVM tuned like the spark-submit JVMs of the tests (tests/jvms.py): smoke figures mean nothing
    env = {**os.environ, **HEAP_MALLOC, **submit_env(), "MMPACK_BENCH_OUT": str(out), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(results), *run_order(BENCHMARKS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return (json.loads(results.read_text()) if results.exists() else {}), done


def test_every_benchmark_is_covered():
    assert len(BENCHMARKS) >= 8 and "bench_pack_spark.py" in BENCHMARKS
    assert sorted(run_order(BENCHMARKS)) == BENCHMARKS


@pytest.mark.parametrize("script", BENCHMARKS)
def test_the_benchmark_runs_in_smoke_mode(script, smoke_runs):
    runs, runner = smoke_runs
    assert script in runs, (
        f"the smoke runner stopped before {script} (exit {runner.returncode}):\n"
        f"{runner.stdout[-3000:]}\n{runner.stderr[-6000:]}"
    )
    run = runs[script]
    assert run["ok"], f"{script} --smoke failed:\n{run['stdout']}\n{run['error']}\n{runner.stderr[-3000:]}"
