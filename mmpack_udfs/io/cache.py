"""mmpack's cache on this machine (``MMPACK_CACHE``, else ``~/.cache/mmpack``): verdicts of
checks keyed by what they depend on, and copies of ``s3://`` model directories."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from mmpack_udfs.io import fs

HASHED_FILE_BYTES = 64 * 2**20  # larger files (model weights) are identified by name and size


def cache_dir() -> Path:
    return Path(os.environ.get("MMPACK_CACHE", Path.home() / ".cache" / "mmpack"))


def checks_dir() -> Path:
    """Where verdicts and facts about tokenizer directories are cached (by their content)."""
    return cache_dir() / "tokenizer-checks"


def cached_verdict(verdict: Path, name: str, check: Callable[[], bool], **facts: str) -> bool:
    """The verdict ``name`` saved in the file ``verdict``, or ``check()``'s, saved there with
    ``facts`` (atomically; a read-only cache only costs the check again next time)."""
    return bool(cached_json(verdict, lambda: {**facts, name: check()})[name])


def cached_json(path: Path, compute: Callable[[], dict]) -> dict:
    """The JSON object saved at ``path``, or ``compute()``'s, saved there atomically (a
    read-only cache only costs the computation again next time)."""
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    return result


def directory_key(path: str) -> str:
    """A hash of what AutoTokenizer's result depends on: the directory's files and the
    transformers and tokenizers versions."""
    digest = hashlib.sha256()
    for package in ("transformers", "tokenizers"):
        digest.update(f"{package}={metadata.version(package)}\n".encode())
    for file in sorted(Path(path).iterdir()):
        if not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}\n".encode())
        if size <= HASHED_FILE_BYTES:
            digest.update(fs.LOCAL.sha256_of(str(file))[0].encode())
    return digest.hexdigest()
