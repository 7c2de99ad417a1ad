"""The manifest and its shards, local or on S3: format checks, sha256 checks, row-group reads.

One ``ShardSource`` per process (each dataloader worker builds its own, lazily): the
pyarrow filesystem is created on first use, never pickled, and credentials come from the
standard AWS chain inside pyarrow (nothing here sees or logs them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs
from mmpack_udfs.pack import costs


class ShardError(MmpackError, RuntimeError):
    """A manifest or shard is missing, of an unknown format, or not what the manifest says."""


def load_manifest(manifest_uri: str, storage: fs.Storage) -> dict[str, Any]:
    """Read and check manifest.json (a path, a folder holding it, or s3://...)."""
    uri = manifest_uri if manifest_uri.endswith(".json") else fs.join(manifest_uri, schemas.MANIFEST_NAME)
    try:
        manifest = schemas.load_manifest(uri, storage)
    except schemas.ManifestError as err:
        raise ShardError(str(err)) from err
    manifest["_root"] = uri.rsplit("/", 1)[0]
    return manifest


class ShardSource:
    """Opens the manifest's shards on demand, verifies each once, reads row groups."""

    def __init__(self, manifest: Mapping[str, Any], storage: fs.Storage, verify: bool) -> None:
        self.manifest, self.storage, self.verify = manifest, storage, verify
        self._files: dict[int, pq.ParquetFile] = {}

    def uri(self, shard: int) -> str:
        return fs.join(self.manifest["_root"], self.manifest["shards"][shard]["path"])

    def nested_columns(self, shard: int, column: str, fields: list[str]) -> list[str]:
        """Parquet paths of some fields of a list<struct> column (to read them without the rest)."""
        return schemas.nested_field_paths(self._open(shard).schema, column, fields)

    def has_column(self, shard: int, column: str) -> bool:
        return column in self._open(shard).schema_arrow.names

    def cost_index(self) -> pa.Table:
        """The manifest's cost index, checked (costs.read_index; its sha256 when verifying)."""
        try:
            return costs.read_index(self.manifest["_root"], self.manifest, self.storage, self.verify)
        except costs.CostIndexError as err:
            raise ShardError(str(err)) from err

    def read(self, shard: int, row_group: int, columns: list[str]) -> pa.Table:
        return self._open(shard).read_row_group(row_group, columns=columns)

    def _open(self, shard: int) -> pq.ParquetFile:
        if shard not in self._files:
            uri = self.uri(shard)
            filesystem, path = self.storage.filesystem(uri)
            try:
                if self.verify:
                    self._check(shard, uri)
                self._files[shard] = pq.ParquetFile(filesystem.open_input_file(path))
            except FileNotFoundError as err:
                raise ShardError(f"shard {uri} named by the manifest is missing") from err
            except OSError as err:  # S3 reports a missing key as an OSError
                raise ShardError(f"shard {uri} named by the manifest cannot be read: {err}") from err
        return self._files[shard]

    def _check(self, shard: int, uri: str) -> None:
        expected = self.manifest["shards"][shard]
        sha256, size = self.storage.sha256_of(uri)
        if size != expected["bytes"] or sha256 != expected["sha256"]:
            raise ShardError(
                f"shard {uri} does not match the manifest: {size} bytes, sha256 {sha256} "
                f"(manifest: {expected['bytes']} bytes, sha256 {expected['sha256']})"
            )
