"""What the benchmark scripts share: where results go, the Spark session, the machine line."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GIB = 1 << 30
OUT = Path(os.environ.get("MMPACK_BENCH_OUT") or Path(__file__).resolve().parent / "out")


def parse_with_smoke(parser: argparse.ArgumentParser, argv: list[str] | None = None, **tiny: Any):
    """``parser``'s arguments plus ``--smoke``: the benchmark at tiny sizes (``tiny``: the
    values it takes then), seconds long. ``make test`` runs every benchmark that way
    (tests/bench), so a benchmark that breaks fails CI; figures of a smoke run mean nothing."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in tiny.items():
            setattr(args, name, value)
    return args


def bench_spark(master: str, driver_memory: str = "4g"):
    """A quiet local SparkSession for benchmarks, with mmpack's own Spark settings (those of
    ``mmpack run``: Arrow batch size, shuffle partitions) plus the bench's. (Imported here: the
    GPU check runs where neither pyspark nor psutil is installed.)"""
    from mmpack_udfs.config.model import SparkConfig
    from mmpack_udfs.io.spark import get_spark

    OUT.mkdir(parents=True, exist_ok=True)
    conf = {**SparkConfig().conf, "spark.ui.enabled": "false", "spark.driver.memory": driver_memory}
    return get_spark(SparkConfig(master=master, log_level="ERROR", conf=conf))


# The smoke runs' image demo (bench_loader, bench_loader_media, bench_gpu_train share it): 60
# samples in bins of 4,096 tokens (its longest sample has 3,762), so that a smoke step is small.
SMOKE_DEMO_SAMPLES, SMOKE_DEMO_BUDGET = 60, 4096


def ensure_image_demo(samples: int, budget: int | None = None, name: str = "loader-demo") -> Path:
    """OUT/``name``/packed: the data of `mmpack demo` (``samples`` samples, real images and
    videos) run through the pipeline for Qwen2-VL (``budget``: its pack.budget), made when it is
    not there. It runs in this process (`mmpack run`), in its Spark session if it has one: the
    smoke runner's JVM is warm, where a `mmpack demo` process would start its own."""
    out = OUT / name
    if not (out / "packed" / "manifest.json").exists():
        from mmpack_udfs.demo import data as demo_data

        demo = demo_data.generate(out / "input", samples=samples)
        command = ["run", "--config", str(demo.config), "--out", str(out), "--master", "local[2]"]
        if budget is not None:
            command += ["--set", f"pack.budget={budget}"]
        run_cli(command)
    return out / "packed"


def run_cli(command: list[str]) -> None:
    """``mmpack COMMAND`` in this process, its summary not printed: in this process's Spark
    session when it has one (the smoke runner's JVM is warm, where a new `mmpack` process would
    start its own). A RuntimeError if it exits other than 0."""
    from mmpack_udfs import cli

    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(command)
    if code != 0:
        raise RuntimeError(f"mmpack {' '.join(command)} exited {code}")


def timed_tokens(tokens_per_item: Iterable[int]) -> dict:
    """Items, tokens and tokens/s of iterating ``tokens_per_item`` (each item's token count)."""
    started, items, tokens = time.perf_counter(), 0, 0
    for count in tokens_per_item:
        items, tokens = items + 1, tokens + count
    seconds = time.perf_counter() - started
    return {
        "bins": items,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds),
    }


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on loopback, in its own process; yields its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


class PeakMemory(threading.Thread):
    """Samples the resident memory of a driver process (``pid``; default this one) and its
    descendants every ``every`` s; keeps the peak per kind: driver, jvm, worker (one Python
    worker), workers (all Python workers at once)."""

    def __init__(self, every: float = 0.25, pid: int | None = None) -> None:
        super().__init__(daemon=True)
        self.every, self.pid, self.stop = every, pid, threading.Event()
        self.peak = {"driver": 0, "jvm": 0, "worker": 0, "workers": 0}

    def run(self) -> None:
        import psutil

        try:
            me = psutil.Process(self.pid)
        except psutil.Error:
            return  # the process has ended already
        while not self.stop.is_set():
            workers = 0
            try:
                self._keep("driver", me.memory_info().rss)
                children = me.children(recursive=True)
            except psutil.Error:
                return  # the driver has ended
            for child in children:
                try:
                    kind, rss = child.name(), child.memory_info().rss
                except psutil.Error:
                    continue
                if kind == "java":
                    self._keep("jvm", rss)
                elif kind.startswith("python"):
                    self._keep("worker", rss)
                    workers += rss
            self._keep("workers", workers)
            time.sleep(self.every)

    def _keep(self, kind: str, rss: int) -> None:
        self.peak[kind] = max(self.peak[kind], rss)

    def gib(self) -> dict[str, float]:
        return {kind: round(value / GIB, 3) for kind, value in self.peak.items()}
