"""One writer per output root: a real second process holds the lock, then is killed -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mmpack_udfs import cli
from mmpack_udfs.io import lock

ROOT = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from mmpack_udfs.io import lock
with lock.output_lock(sys.argv[1], ["pack"]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """A separate process holding the lock of ``tmp_path / 'out'``."""
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    yield out, process
    process.kill()
    process.wait()


def test_a_second_run_is_refused_naming_the_holder(holder, capsys):
    out, process = holder
    refused = rf"in use by another run \(pack: pid {process.pid} on"
    with pytest.raises(lock.OutputLockedError, match=refused), lock.output_lock(str(out), ["normalize"]):
        pass
    assert cli.main(["validate", "--out", str(out)]) == cli.EXIT_FAILED  # refused before Spark starts
    assert "is in use by another run" in capsys.readouterr().err
    assert json.loads((out / lock.LOCK_NAME).read_text())["pid"] == process.pid  # not disturbed


def test_the_lock_of_a_killed_run_is_taken_over(holder, caplog):
    out, process = holder
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert (out / lock.LOCK_NAME).exists()  # kill -9 leaves it behind
    with lock.output_lock(str(out), ["normalize"]) as owner:
        assert json.loads((out / lock.LOCK_NAME).read_text())["token"] == owner["token"]
    assert "taking over the lock" in caplog.text
    assert not (out / lock.LOCK_NAME).exists()


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), lock.output_lock(str(tmp_path), ["pack"]):
        raise RuntimeError("boom")
    assert not (tmp_path / lock.LOCK_NAME).exists()
    with lock.output_lock(str(tmp_path), ["pack"]):
        assert (tmp_path / lock.LOCK_NAME).exists()


def test_a_lock_held_on_s3_by_another_host_is_refused(s3_bucket):
    from mmpack_udfs.io import fs

    endpoint, bucket = s3_bucket
    storage = fs.Storage(fs.S3Options(endpoint_override=endpoint, scheme="http", region="us-east-1"))
    out = f"s3://{bucket}/run"
    with lock.output_lock(out, ["normalize"], storage):
        assert storage.exists(f"{out}/{lock.LOCK_NAME}")
    assert not storage.exists(f"{out}/{lock.LOCK_NAME}")
    other = {"token": "x", "host": "elsewhere", "pid": 1, "stages": ["tokenize"], "started": 0}
    storage.write_bytes(f"{out}/{lock.LOCK_NAME}", json.dumps(other).encode())
    with (
        pytest.raises(lock.OutputLockedError, match="pid 1 on elsewhere"),
        lock.output_lock(out, ["pack"], storage),
    ):
        pass
