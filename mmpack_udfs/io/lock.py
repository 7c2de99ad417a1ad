"""One writer per output root: ``OUT/_mmpack_lock.json`` names the run that holds it.

Two runs writing one root commit each other's files, read part files the other is
rewriting, and print summaries of what the other then publishes. The CLI (and so every
spark-submit job and the Airflow DAG's tasks) takes this lock before its stages and gives
it back after them, even when they fail.

- Local roots: the lock file is created exclusively (``O_CREAT | O_EXCL``): of two runs
  exactly one gets it.
- S3 roots: pyarrow cannot create an object only-if-absent, so the lock is checked,
  written, then read back to confirm its owner; two runs starting within that moment
  can still both pass. Give each concurrent job its own output root on S3.
- A lock whose owner ran on this host and is no longer alive (killed, crashed) is taken
  over, with a line saying so. Any other held lock is refused with its owner, host and
  age; if that run is known to be dead (its machine is gone), delete the file and re-run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs

log = logging.getLogger(__name__)

LOCK_NAME = "_mmpack_lock.json"


class OutputLockedError(MmpackError, RuntimeError):
    """Another run holds the output root."""


@contextmanager
def output_lock(output: str, stages: Sequence[str], storage: fs.Storage = fs.LOCAL) -> Iterator[dict]:
    """Hold ``output``'s lock while the block runs; yields the owner record written."""
    uri = fs.join(output, LOCK_NAME)
    owner = {
        "token": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "stages": list(stages),
        "started": time.time(),
    }
    _acquire(uri, owner, storage)
    try:
        yield owner
    finally:
        holder = _read(uri, storage)
        if holder is not None and holder.get("token") == owner["token"]:
            _delete(uri, storage)


def _acquire(uri: str, owner: dict, storage: fs.Storage) -> None:
    for _ in range(2):  # a second try after taking over a dead owner's lock
        if _create(uri, owner, storage):
            return
        holder = _read(uri, storage)
        if holder is None:
            continue  # released between our two looks
        if _dead_here(holder):
            log.warning("taking over the lock of run pid %s on this host, which is gone", holder["pid"])
            _delete(uri, storage)
            continue
        age = (time.time() - float(holder.get("started", time.time()))) / 60
        raise OutputLockedError(
            f"{uri.rsplit('/', 1)[0]} is in use by another run ({', '.join(holder.get('stages', []))}: "
            f"pid {holder.get('pid')} on {holder.get('host')}, started {age:.0f} min ago). Wait for it "
            f"to finish, use another output root, or, if that run is dead, delete {uri} and re-run."
        )
    raise OutputLockedError(f"could not take the lock {uri}")


def _create(uri: str, owner: dict, storage: fs.Storage) -> bool:
    data = json.dumps(owner).encode()
    if not fs.is_s3(uri):
        path = fs.LOCAL.filesystem(uri)[1]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as f:
            f.write(data)
        return True
    if storage.exists(uri):
        return False
    storage.write_bytes(uri, data)
    holder = _read(uri, storage)
    return holder is not None and holder.get("token") == owner["token"]


def _read(uri: str, storage: fs.Storage) -> dict | None:
    """The lock's owner record; None when there is no lock."""
    try:
        return json.loads(storage.read_bytes(uri))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {} if storage.exists(uri) else None  # a half-written lock is held, by someone


def _delete(uri: str, storage: fs.Storage) -> None:
    filesystem, path = storage.filesystem(uri)
    with suppress(FileNotFoundError):
        filesystem.delete_file(path)


def _dead_here(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by someone else
        return False
    return False
