"""Run benchmark scripts in their smoke mode one after the other in this one process, and write
each one's outcome to a JSON file (what tests/bench/test_bench_smoke.py checks).

One process for all of them: Python imports torch, transformers and pyspark once, and the
Spark benchmarks share one JVM (``bench_spark`` reuses the session), where a process per
script paid both every time. Each script still runs as ``__main__`` with ``--smoke`` as its
only argument, exactly as ``python bench/<script> --smoke`` runs it.

    python tests/bench/smoke_runner.py RESULTS.json bench_a.py bench_b.py ...
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_smoke(script: Path) -> dict:
    """``script --smoke`` as ``__main__``: whether it ended well, its error, the end of what it
    printed and its seconds."""
    sys.argv = [str(script), "--smoke"]
    printed = io.StringIO()
    started = time.perf_counter()
    error = ""
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (None, 0):
            error = f"SystemExit({exit.code!r})"
    except Exception:
        error = traceback.format_exc()
    return {
        "ok": not error,
        "error": error,
        "stdout": printed.getvalue()[-3000:],
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    results_path, scripts = Path(sys.argv[1]), sys.argv[2:]
    sys.path.insert(0, str(BENCH))  # the scripts import bench/common.py, as when run from bench/
    results: dict[str, dict] = {}
    for name in scripts:
        result = results[name] = run_smoke(BENCH / name)
        results_path.write_text(json.dumps(results, indent=2))  # after each: a crash keeps what ran
        print(f"{name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
