"""One way to reach files: local paths and s3:// URIs through pyarrow.fs.

Spark has no S3 connector here (no hadoop-aws), so executors and the driver open S3
objects themselves with ``pyarrow.fs.S3FileSystem``, and Delta tables go through delta-rs.
Both take credentials from the standard AWS chain (environment, shared credentials and
config files with ``AWS_PROFILE``, web identity, container and instance roles), never
from mmpack's config, and they are never logged. ``s3a://`` and ``s3n://`` (what Spark
users write) are the same as ``s3://``; mmpack writes ``s3://``.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import pyarrow.fs as pafs

from mmpack_udfs.constants import S3_SCHEMES


@dataclass(frozen=True)
class S3Options:
    """How to reach S3 (or an S3-compatible store): the ``s3`` config section."""

    endpoint_override: str | None = None
    region: str | None = None
    scheme: str | None = None
    connect_timeout: float = 10
    request_timeout: float = 60
    retries: int = 5

    @classmethod
    def from_config(cls, section: Any) -> S3Options:
        """From the ``s3`` config section (its model or a mapping) or None (the defaults)."""
        if section is None:
            return cls()
        values = section if isinstance(section, Mapping) else section.model_dump()
        return cls(**values)


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_SCHEMES)


def _s3_path(uri: str) -> str:
    """``bucket/key`` of an S3 URI in any of ``S3_SCHEMES``."""
    return uri.split("://", 1)[1]


def join(base: str, *parts: str) -> str:
    """Join URI or path parts with '/', keeping an s3:// scheme intact."""
    out = base.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


@lru_cache(maxsize=8)
def _s3_filesystem(options: S3Options) -> pafs.S3FileSystem:
    kwargs: dict[str, Any] = {
        "connect_timeout": options.connect_timeout,
        "request_timeout": options.request_timeout,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=options.retries),
    }
    if options.endpoint_override:
        kwargs["endpoint_override"] = options.endpoint_override
    if options.region:
        kwargs["region"] = options.region
    if options.scheme:
        kwargs["scheme"] = options.scheme
    return pafs.S3FileSystem(**kwargs)


def normalize_uri(uri: str) -> str:
    """An absolute local path or an s3:// URI (from s3a:// and s3n:// too), without a
    trailing slash."""
    if is_s3(uri):
        return f"s3://{_s3_path(uri)}".rstrip("/")
    return os.path.abspath(uri[len("file://") :] if uri.startswith("file://") else uri)


@dataclass(frozen=True)
class Storage:
    """Every file access of a run: local paths and s3:// URIs, with one S3 setup. Resolved once
    per run (``context.RunContext``); small, hashable and picklable, so it travels to
    executors inside a task and its S3 filesystem is built once per worker."""

    s3: S3Options = field(default_factory=S3Options)

    def filesystem(self, uri: str) -> tuple[pafs.FileSystem, str]:
        """The filesystem for ``uri`` and the path to use on it."""
        if is_s3(uri):
            return _s3_filesystem(self.s3), _s3_path(uri)
        path = uri[len("file://") :] if uri.startswith("file://") else uri
        return pafs.LocalFileSystem(), os.path.abspath(path)

    def delta_options(self, uri: str) -> dict[str, str] | None:
        """delta-rs storage options for an S3 table: the ``s3`` section's endpoint, and the
        region pyarrow's S3 resolves (the config's, else the AWS chain's); credentials from
        the whole AWS default chain (``AWS_FORCE_CREDENTIAL_LOAD``: without it delta-rs
        reads only environment variables and instance metadata, not profiles)."""
        if not is_s3(uri):
            return None
        s3 = self.s3
        options = {
            "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
            "AWS_FORCE_CREDENTIAL_LOAD": "true",
            "AWS_REGION": s3.region or _s3_filesystem(s3).region or "us-east-1",
        }
        if s3.endpoint_override:
            endpoint = s3.endpoint_override
            if "://" not in endpoint:
                endpoint = f"{s3.scheme or 'https'}://{endpoint}"
            options["AWS_ENDPOINT_URL"] = endpoint
            if endpoint.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        return options

    def expand(self, pattern: str) -> list[str]:
        """Files named by a path, a directory (recursively) or a glob; sorted, hidden files skipped."""
        if not is_s3(pattern):
            matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
            files: list[str] = []
            for match in matches:
                if os.path.isdir(match):
                    for root, dirs, names in os.walk(match):
                        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
                        files += [
                            os.path.join(root, n) for n in sorted(names) if not n.startswith((".", "_"))
                        ]
                elif os.path.exists(match):
                    files.append(match)
            return sorted({os.path.abspath(f) for f in files})
        fs, path = self.filesystem(pattern)
        if glob.has_magic(path):
            prefix = path[: min(path.index(c) for c in "*?[" if c in path)].rsplit("/", 1)[0]
            infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
            keep = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path)]
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.File:
                keep = [path]
            elif info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
                keep = [i.path for i in infos if i.type == pafs.FileType.File]
            else:
                keep = []
        visible = [k for k in keep if not os.path.basename(k).startswith((".", "_"))]
        return sorted(f"s3://{k}" for k in visible)

    def file_info(self, uri: str) -> pafs.FileInfo:
        fs, path = self.filesystem(uri)
        return fs.get_file_info(path)

    def read_bytes(self, uri: str, start: int = 0, length: int | None = None) -> bytes:
        """Read a whole file, or ``length`` bytes from ``start``."""
        fs, path = self.filesystem(uri)
        with fs.open_input_file(path) as f:
            if start:
                f.seek(start)
            return f.read() if length is None else f.read(length)

    @contextmanager
    def atomic_output(self, uri: str) -> Iterator[Any]:
        """An output stream whose content appears under ``uri`` only once it is complete: locally
        a dot-temporary file of this writer's own (process and thread: two tasks may write the
        same content-addressed file at once) in the same folder, renamed at the end (removed on
        failure); on S3 an upload, which becomes visible when it completes."""
        fs, path = self.filesystem(uri)
        if is_s3(uri):
            with fs.open_output_stream(path) as stream:
                yield stream
            return
        folder, name = os.path.split(path)
        fs.create_dir(folder, recursive=True)
        temporary = os.path.join(folder, f".{name}.{os.getpid()}-{threading.get_ident()}.tmp")
        stream = fs.open_output_stream(temporary)
        try:
            yield stream
            if not stream.closed:
                stream.close()
            fs.move(temporary, path)
        except BaseException:
            if not stream.closed:
                stream.close()
            fs.delete_file(temporary)
            raise

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write a whole file (atomically on local disks: see ``atomic_output``)."""
        with self.atomic_output(uri) as f:
            f.write(data)

    def sha256_of(self, uri: str, chunk_bytes: int = 8 << 20) -> tuple[str, int]:
        """The sha256 (hex) and size in bytes of a file, streamed in chunks."""
        fs, path = self.filesystem(uri)
        digest, size = hashlib.sha256(), 0
        with fs.open_input_stream(path) as f:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
                size += len(chunk)
        return digest.hexdigest(), size

    def exists(self, uri: str) -> bool:
        return self.file_info(uri).type != pafs.FileType.NotFound

    def delete_dir(self, uri: str) -> None:
        """Delete a folder and everything in it (on S3: every key under it and its marker)."""
        fs, path = self.filesystem(uri)
        fs.delete_dir(path)


LOCAL = Storage()  # local files only (and S3 with the default setup)


class HashingSink:
    """A write-only file object that hashes (sha256) and counts what it passes on to ``stream``,
    for a file's manifest entry written on the way out; closing it closes ``stream``."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.sha256, self.size, self.closed = stream, hashlib.sha256(), 0, False

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        self.stream.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.stream.close()
            self.closed = True

    def hexdigest(self) -> str:
        return self.sha256.hexdigest()
