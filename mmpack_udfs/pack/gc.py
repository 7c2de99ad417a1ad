"""``mmpack gc``: remove the shard files of failed or superseded packs.

A pack writes its shards under ``OUT/packed/shards/<run tag>/`` and publishes them by
writing ``manifest.json`` last, so a killed pack or a replaced one leaves files behind
that nothing names. This deletes every file under ``OUT/packed/shards/`` that the
published manifest does not name, and never one it names. The CLI holds the output
root's lock meanwhile, so no pack can be writing new shards.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs

from mmpack_udfs import schemas
from mmpack_udfs.io import fs


def collect(output: str, storage: fs.Storage = fs.LOCAL, dry_run: bool = False) -> dict[str, Any]:
    """Delete (or with ``dry_run`` only list) unnamed shard files; return what was found."""
    packed = schemas.packed_uri(output)
    manifest_uri = fs.join(packed, schemas.MANIFEST_NAME)
    named: set[str] = set()
    if storage.exists(manifest_uri):
        manifest = json.loads(storage.read_bytes(manifest_uri))
        named = {fs.join(packed, shard["path"]) for shard in manifest["shards"]}
        if "cost_index" in manifest:
            named.add(fs.join(packed, manifest["cost_index"]["path"]))
    filesystem, root = storage.filesystem(fs.join(packed, "shards"))
    selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    files = [i for i in filesystem.get_file_info(selector) if i.type == pafs.FileType.File]
    prefix = "s3://" if fs.is_s3(packed) else ""
    unnamed = [i for i in files if prefix + i.path not in named]
    if not dry_run:
        for info in unnamed:
            filesystem.delete_file(info.path)
    return {
        "kept": len(files) - len(unnamed),
        "unnamed": [prefix + i.path for i in unnamed],
        "bytes": sum(i.size for i in unnamed),
        "deleted": not dry_run,
    }


def format_summary(found: dict[str, Any]) -> str:
    verb = "removed" if found["deleted"] else "would remove"
    return (
        f"gc: kept {found['kept']} shard file(s) named by the manifest; {verb} {len(found['unnamed'])} "
        f"file(s), {found['bytes'] / 2**20:.1f} MiB, of failed or superseded packs"
    )
