"""A class-data-sharing (CDS) archive of the classes an embedded Spark JVM loads at start.

A fresh local Spark session spends most of its start reading, parsing and verifying several
thousand classes from Spark's jars. Java's CDS maps them from an archive made once instead:
a fresh session with a small job took 3.9-4.2 s instead of 7.1-8.4 s (bench/RESULTS.md, "Test
suite time"), for every `mmpack` command.

Java 17 cannot make the archive while it runs (JDK 19's ``-XX:+AutoCreateSharedArchive``), so
``build()`` makes it once, in a JVM of its own: a small job under ``-XX:ArchiveClassesAtExit``,
written under a temporary name and renamed into place once that JVM has exited, so no JVM ever
maps a half-written archive. ``make setup`` builds it; so does
``python -m mmpack_udfs.io.class_archive``. Its name holds a digest of the JDK and of Spark's
jars, so another JDK or Spark uses (or builds) its own; a JVM whose classpath, heap mode or jars
no longer match what the archive recorded ignores it (``-Xshare:auto``, Java's default) and loads
its classes as before, silently (its ``cds`` logging is off). Only the embedded JVM
(`mmpack run` and friends, local or client mode) uses it: spark-submit and a cluster's executors
start their JVMs their own way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mmpack_udfs.io.cache import cache_dir

DUMP_ENV = "MMPACK_CLASS_ARCHIVE_DUMP"  # set for the build's own JVM: where it writes at exit
QUIET = ["-Xlog:cds=off", "-Xlog:cds+dynamic=off"]  # a stale archive is skipped without a word


def java_home() -> Path | None:
    """The JDK pyspark starts: ``JAVA_HOME``'s, else the ``java`` on the PATH."""
    if home := os.environ.get("JAVA_HOME"):
        return Path(home)
    java = shutil.which("java")
    return Path(java).resolve().parent.parent if java else None


def spark_jars() -> Path | None:
    """pyspark's jars folder (found without importing pyspark)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return None
    jars = Path(spec.origin).parent / "jars"
    return jars if jars.is_dir() else None


def archive_path() -> Path | None:
    """Where this JDK and Spark's archive lives (``MMPACK_CACHE``/jvm), or None without either."""
    home, jars = java_home(), spark_jars()
    if home is None or jars is None:
        return None
    digest = hashlib.sha256(str(home.resolve()).encode())
    release = home / "release"
    digest.update(release.read_bytes() if release.is_file() else b"")
    for jar in sorted(jars.iterdir()):
        stat = jar.stat()
        digest.update(f"{jar} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return cache_dir() / "jvm" / f"spark-classes-{digest.hexdigest()[:16]}.jsa"


def java_options() -> list[str]:
    """The embedded JVM's options for the archive: the build's dump at exit; else the archive
    where it exists; else none."""
    if dump := os.environ.get(DUMP_ENV):
        return [f"-XX:ArchiveClassesAtExit={dump}", *QUIET]
    archive = archive_path()
    if archive is None or not archive.is_file():
        return []
    return [f"-XX:SharedArchiveFile={archive}", *QUIET]


def build() -> Path | None:
    """This machine's archive, made first where there is none (about 30 s: a JVM runs a small job
    and writes what it loaded as it exits); None without a JDK or pyspark, or where the build
    failed (sessions then start as before)."""
    target = archive_path()
    if target is None or target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    env = {**os.environ, DUMP_ENV: str(partial)}
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-m", "mmpack_udfs.io.class_archive_job", work]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        print(f"mmpack: no class archive ({done.stderr.strip()[-500:]})", file=sys.stderr)
        return None
    partial.replace(target)  # atomic: a JVM maps the whole archive or none
    return target


if __name__ == "__main__":
    print(build() or "no class archive: no JDK or pyspark here, or its build failed")
