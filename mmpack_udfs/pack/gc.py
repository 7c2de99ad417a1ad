"""``mmpack gc``: remove the shard files of failed or superseded packs.

A pack writes its shards under ``OUT/packed/shards/<run tag>/`` (and, while its tasks run,
the placement they read under ``_placement/`` there) and publishes them by writing
``manifest.json`` last, so a killed pack or a replaced one leaves files behind that nothing
names. This deletes every file under ``OUT/packed/shards/`` (and
``OUT/packed-eval/shards/``) that the published manifests do not name, and never one they
name. The CLI holds the output
root's lock meanwhile, so no pack can be writing new shards.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs

from mmpack_udfs import schemas
from mmpack_udfs.io import fs


def collect(output: str, storage: fs.Storage = fs.LOCAL, dry_run: bool = False) -> dict[str, Any]:
    """Delete (or with ``dry_run`` only list) unnamed shard files of the training pack and of
    the evaluation pack (whose files count as named only while the training manifest names
    its run); return what was found."""
    packed, packed_eval = schemas.packed_uri(output), schemas.packed_eval_uri(output)
    train = _manifest(packed, storage)
    evaluation = _manifest(packed_eval, storage)
    named_eval = (train or {}).get("eval") or {}
    live_eval = evaluation if evaluation and evaluation.get("run_id") == named_eval.get("run_id") else None
    files, unnamed = 0, []
    for root, manifest in ((packed, train), (packed_eval, live_eval)):
        filesystem, found, gone = _unnamed(root, manifest, storage)
        files, unnamed = files + found, unnamed + gone
        if not dry_run:
            for info in gone:
                filesystem.delete_file(info.path)
    prefix = "s3://" if fs.is_s3(packed) else ""
    return {
        "kept": files - len(unnamed),
        "unnamed": [prefix + i.path for i in unnamed],
        "bytes": sum(i.size for i in unnamed),
        "deleted": not dry_run,
    }


def _manifest(root: str, storage: fs.Storage) -> dict[str, Any] | None:
    uri = fs.join(root, schemas.MANIFEST_NAME)
    return json.loads(storage.read_bytes(uri)) if storage.exists(uri) else None


def _unnamed(root: str, manifest: dict[str, Any] | None, storage: fs.Storage) -> tuple[Any, int, list]:
    """The filesystem of ``root/shards``, how many files lie under it, and those ``manifest``
    does not name."""
    named: set[str] = set()
    if manifest is not None:
        named = {fs.join(root, shard["path"]) for shard in manifest["shards"]}
        if "cost_index" in manifest:
            named.add(fs.join(root, manifest["cost_index"]["path"]))
    filesystem, base = storage.filesystem(fs.join(root, "shards"))
    selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
    files = [i for i in filesystem.get_file_info(selector) if i.type == pafs.FileType.File]
    prefix = "s3://" if fs.is_s3(root) else ""
    return filesystem, len(files), [i for i in files if prefix + i.path not in named]


def format_summary(found: dict[str, Any]) -> str:
    verb = "removed" if found["deleted"] else "would remove"
    return (
        f"gc: kept {found['kept']} shard file(s) named by the manifest; {verb} {len(found['unnamed'])} "
        f"file(s), {found['bytes'] / 2**20:.1f} MiB, of failed or superseded packs"
    )
