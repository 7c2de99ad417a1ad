"""Every benchmark in bench/ runs in its smoke mode (tiny sizes, seconds): a benchmark that
breaks (an API it calls changed, a flag went missing) fails the suite instead of rotting
until someone needs its figures. The figures of a smoke run mean nothing; bench/RESULTS.md
holds the real ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.name for p in (ROOT / "bench").glob("bench_*.py"))
TIMEOUT_S = 600

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory) -> Path:
    """One output folder for the run: bench_loader reads what bench_pack_spark writes."""
    return tmp_path_factory.mktemp("bench-out")


def test_every_benchmark_is_covered():
    assert len(BENCHMARKS) >= 8 and "bench_pack_spark.py" in BENCHMARKS


@pytest.mark.parametrize("script", BENCHMARKS)
def test_the_benchmark_runs_in_smoke_mode(script, bench_out):
    env = {**os.environ, "MMPACK_BENCH_OUT": str(bench_out), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"{script} --smoke failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
