"""Live progress of a stage, from Spark's status tracker: tasks done / total, rate, ETA.

``with stage_progress(spark, "tokenize", every): ...`` tags the stage's Spark jobs with a
job group and watches them from a daemon thread. On a terminal one line is rewritten in
place; elsewhere (CI, Airflow logs, a pipe) a plain line is written every ``every``
seconds while tasks move, and one when the stage ends.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO


@dataclass(frozen=True)
class Tasks:
    """Tasks of a stage's Spark jobs so far: done (completed) of total."""

    done: int
    total: int
    failed: int = 0


def format_progress(name: str, tasks: Tasks, seconds: float) -> str:
    """``tokenize: 12/40 tasks (30 %), 1.5 tasks/s, 18 s elapsed, ETA 19 s``."""
    share = f" ({100 * tasks.done // tasks.total} %)" if tasks.total else ""
    line = f"{name}: {tasks.done}/{tasks.total} tasks{share}, {seconds:.0f} s elapsed"
    if tasks.done and seconds > 0:
        rate = tasks.done / seconds
        line += f", {rate:.2g} tasks/s"
        if tasks.total > tasks.done:
            line += f", ETA {(tasks.total - tasks.done) / rate:.0f} s"
    if tasks.failed:
        line += f", {tasks.failed} failed attempts (retried)"
    return line


class _Watcher:
    """Polls the status tracker for one job group and writes progress lines."""

    def __init__(self, spark, name: str, every: float, stream: IO[str]) -> None:
        self.tracker = spark.sparkContext.statusTracker()
        self.name, self.every, self.stream = name, every, stream
        self.group = f"mmpack-{name}-{time.time_ns()}"
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.stages: dict[int, Tasks] = {}  # stage info lingers; keep the last seen per stage

    def tasks(self) -> Tasks:
        for job_id in self.tracker.getJobIdsForGroup(self.group):
            job = self.tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else ():
                info = self.tracker.getStageInfo(stage_id)
                if info is None:
                    continue
                seen = Tasks(info.numCompletedTasks, info.numTasks, info.numFailedTasks)
                if job.status != "RUNNING" and seen.done < seen.total and not info.numActiveTasks:
                    self.stages.pop(stage_id, None)  # skipped: its output came from an earlier job
                else:
                    self.stages[stage_id] = seen
        stages = self.stages.values()
        return Tasks(sum(s.done for s in stages), sum(s.total for s in stages), sum(s.failed for s in stages))

    def run(self) -> None:
        shown, last = None, self.started
        interval = min(self.every, 0.5) if self.tty else self.every
        while not self.stop.wait(interval):
            tasks = self.tasks()
            if not tasks.total:
                continue
            now = time.monotonic()
            if self.tty:
                self.write(format_progress(self.name, tasks, now - self.started), end="\r")
            elif tasks != shown or now - last >= 6 * self.every:  # a line while tasks move, else rarely
                self.write(format_progress(self.name, tasks, now - self.started))
                shown, last = tasks, now

    def finish(self) -> None:
        """The stage's last line (the polling thread has stopped)."""
        tasks = self.tasks()
        if tasks.total:
            self.write(format_progress(self.name, tasks, time.monotonic() - self.started), end="\n")

    def write(self, line: str, end: str = "\n") -> None:
        self.stream.write(("\r\x1b[2K" if self.tty else "") + line + end)
        self.stream.flush()


@contextmanager
def stage_progress(spark, name: str, every: float, stream: IO[str] | None = None) -> Iterator[None]:
    """Show the progress of the Spark jobs started inside the block (``every`` = 0: none)."""
    if every <= 0:
        yield
        return
    watcher = _Watcher(spark, name, every, stream or sys.stderr)
    spark.sparkContext.setJobGroup(watcher.group, f"mmpack {name}")
    thread = threading.Thread(target=watcher.run, name=f"progress-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        watcher.stop.set()
        thread.join()
        watcher.finish()
        for key in ("spark.jobGroup.id", "spark.job.description"):
            spark.sparkContext.setLocalProperty(key, None)  # later jobs belong to no group
