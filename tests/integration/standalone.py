"""A real multi-process Spark cluster on loopback for the tests: a standalone master and two
one-core workers (``spark-class ... Master`` / ``Worker`` from the venv's pyspark), and a
helper that kills a busy executor while a job of a given mmpack stage runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.jvms import daemon_env

SPARK_CLASS = Path(sys.executable).parent / "spark-class"
WORKERS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.load(response)


@dataclass
class Cluster:
    """A running standalone cluster: its master URL and each worker's work directory."""

    url: str
    web: str
    work_dirs: list[Path]
    processes: list[subprocess.Popen] = field(default_factory=list)

    def alive_workers(self) -> int:
        try:
            workers = get_json(f"{self.web}/json/")["workers"]
        except (OSError, ValueError):  # not listening yet, or an empty page while it starts
            return 0
        return sum(w["state"] == "ALIVE" for w in workers)

    def executor_dirs(self) -> list[Path]:
        """Every executor's working directory so far (``<work dir>/<app>/<executor id>``)."""
        return sorted(p.parent for d in self.work_dirs for p in d.glob("app-*/*/stderr"))

    def remove_unpacked_archives(self) -> None:
        """Delete what executors unpacked from ``--archives`` (a virtualenv each, 1.5 GB), keeping
        their logs: a stopped worker leaves its application directories behind."""
        for executor in self.executor_dirs():
            for entry in executor.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def start_cluster(root: Path, worker_memory: str = "2g") -> Cluster:
    """A master and ``WORKERS`` one-core workers, all on 127.0.0.1, logging under ``root``."""
    port, web_port = free_port(), free_port()
    import pyspark

    spark_home = str(Path(pyspark.__file__).parent)
    env = {**os.environ, "SPARK_HOME": spark_home, "SPARK_LOCAL_IP": "127.0.0.1", **daemon_env()}
    cluster = Cluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}", [])

    def launch(name: str, *args: str) -> None:
        log = open(root / f"{name}.log", "w")  # noqa: SIM115 - the process owns it
        command = [str(SPARK_CLASS), *args]
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        cluster.processes.append(process)

    launch("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
           "--port", str(port), "--webui-port", str(web_port))  # fmt: skip
    for i in range(WORKERS):
        work = root / f"worker{i}"
        work.mkdir()
        cluster.work_dirs.append(work)
        launch(f"worker{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
               "--cores", "1", "--memory", worker_memory, "--webui-port", str(free_port()),
               "--work-dir", str(work), cluster.url)  # fmt: skip
    deadline = time.time() + 120
    while cluster.alive_workers() < WORKERS:
        if time.time() > deadline or any(p.poll() is not None for p in cluster.processes):
            cluster.stop()
            logs = "\n".join((root / f).read_text()[-2000:] for f in os.listdir(root) if f.endswith(".log"))
            raise RuntimeError(f"the standalone cluster did not start:\n{logs}")
        time.sleep(0.5)
    return cluster


def executor_pid(app: str, executor: str) -> int | None:
    """The pid of executor ``executor`` of application ``app`` (its JVM's command line)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in args]
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" not in words:
            continue
        if words[words.index("--app-id") + 1] == app and words[words.index("--executor-id") + 1] == executor:
            return int(entry.name)
    return None


class ExecutorKiller(threading.Thread):
    """Polls the driver's REST API on ``ui_port``; while a job of mmpack stage ``stage`` runs,
    SIGKILLs the JVM of one executor running one of its tasks, until Spark records that task
    as failed. A task the API still lists as running may already have ended (the listener
    bus lags): then the kill lost the race, and the next running task is tried.
    ``killed`` is (executor, pid) of the kill that failed a task."""

    def __init__(self, ui_port: int, stage: str) -> None:
        super().__init__(daemon=True)
        self.api = f"http://127.0.0.1:{ui_port}/api/v1"
        self.stage = stage
        self.killed: tuple[str, int] | None = None
        self.lost_races = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and self.killed is None:
            time.sleep(0.1)
            try:
                self._kill_a_busy_executor()
            except (OSError, ValueError, KeyError, IndexError):
                continue  # the driver is not up yet, or is between jobs

    def _kill_a_busy_executor(self) -> None:
        app = get_json(f"{self.api}/applications")[0]["id"]
        jobs = get_json(f"{self.api}/applications/{app}/jobs?status=running")
        if not any(job.get("description") == f"mmpack {self.stage}" for job in jobs):
            return
        for stage in get_json(f"{self.api}/applications/{app}/stages?status=active"):
            stage_uri = f"{self.api}/applications/{app}/stages/{stage['stageId']}/{stage['attemptId']}"
            for task in get_json(f"{stage_uri}/taskList?status=RUNNING"):
                pid = executor_pid(app, task["executorId"])
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    if self._task_failed(stage_uri, task["taskId"]):
                        self.killed = (task["executorId"], pid)
                    else:
                        self.lost_races += 1
                    return

    def _task_failed(self, stage_uri: str, task_id: int) -> bool:
        """Whether Spark ends task ``task_id`` as failed (rather than finished before the kill)."""
        while not self.done.is_set():
            for task in get_json(f"{stage_uri}/taskList?length=100000"):
                if task["taskId"] == task_id and task["status"] != "RUNNING":
                    return task["status"] == "FAILED"
            time.sleep(0.1)
        return False
