"""``mmpack export energon``: a published pack → a Megatron-Energon dataset at DEST.

    driver: the pack's manifest (and its evaluation pack's); refusals, exit 2: no published
            pack, a DEST that is not empty, a split the pack lacks, a family or pack
            Megatron-Core cannot train exactly (``loader.megatron``)
    Spark:  one task per shard: its bytes checked against the manifest (sha256), its bins
            written as one WebDataset tar (``DEST/<split>/shard-NNNNN.tar``), one tar sample
            per bin (``TAR_PARTS``); media the pack only references are embedded
    driver: the tars' bins and samples against the manifests; Energon's own preparation
            (``BaseWebdatasetFactory.prepare_dataset``) writes ``.nv-meta`` (split.yaml,
            .info.json, the index) and the tars' ``.tar.idx``; then ``dataset.yaml`` (a
            CrudeWebdataset: ``loader.energon``'s cooker reads it) and, last,
            ``mmpack_export.json`` (the source pack's run id and sha256s, every tar's)

The same pack gives the same bytes: tar members carry no time or owner, the index is built
by one process into a fresh folder and its uuid derives from the content. On ``s3://`` the
driver prepares a local copy of the tars (Energon's indexer reads every byte of them either
way) and uploads what it wrote. docs/megatron.md describes the tar samples.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.context import RunContext
from mmpack_udfs.errors import EXIT_BAD_CONFIG, MmpackError, ReconciliationError
from mmpack_udfs.io import fs
from mmpack_udfs.io.memory import releasing
from mmpack_udfs.io.spark import one_task_per_row

SPLITS = {"train": "train", "val": "eval"}  # Energon's split → the pack's
ARRAYS = schemas.EXPORT_ARRAYS  # each an int32 .npy part (schemas: the tar sample's parts)
TAR_PARTS = "json, " + ", ".join(f"{a}.npy" for a in ARRAYS) + ", then <i>.media per media item"
DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
WRITTEN = pa.schema([("result", pa.string())])


class ExportRefused(MmpackError, ValueError):
    """A request the export will not carry out; nothing was written."""

    exit_code = EXIT_BAD_CONFIG


def run(
    spark, ctx: RunContext, dest: str, splits: list[str] | None = None, packs: Mapping | None = None
) -> dict[str, Any]:
    """Export ``OUT/packed`` (and ``OUT/packed-eval`` as ``val``) to ``dest``; returns the
    export manifest. Raises ExportRefused (exit 2) before anything is written. ``packs``: what
    ``checked_packs`` returned for the same arguments (the CLI checks before Spark starts)."""
    started = time.time()
    storage, dest = ctx.storage, fs.normalize_uri(dest).rstrip("/")
    packs = packs if packs is not None else checked_packs(ctx, dest, splits)
    entries = [
        {
            "split": split,
            "shard": number,
            "uri": fs.join(root, shard["path"]),
            "sha256": shard["sha256"],
            "bytes": shard["bytes"],
            "tar": f"{split}/shard-{number:05d}.tar",
            "profile": manifest["profile"],
            "profile_digest": schemas.profile_digest(manifest["config"]["profiles"][manifest["profile"]]),
        }
        for split, (root, manifest) in packs.items()
        for number, shard in enumerate(manifest["shards"])
    ]
    task = partial(write_tars, dest=dest, storage=storage)
    listing = one_task_per_row(spark, pa.table({"entry": [json.dumps(e) for e in entries]}))
    from pyspark.sql.pandas.types import from_arrow_schema

    rows = listing.mapInArrow(releasing(task), from_arrow_schema(WRITTEN)).collect()
    tars = sorted((json.loads(r.result) for r in rows), key=lambda t: t["path"])
    reconcile(packs, tars)
    prepare(dest, [t["path"] for t in tars], storage)
    manifest = export_manifest(packs, tars, ctx.output, storage)
    write_index_files(dest, manifest, storage)
    storage.write_bytes(fs.join(dest, schemas.EXPORT_MANIFEST), _json(manifest))  # last: published
    print(format_summary(dest, manifest, time.time() - started))
    return manifest


# -- driver: what is exported, and what is refused ------------------------------------------
def checked_packs(
    ctx: RunContext, dest: str, splits: list[str] | None
) -> dict[str, tuple[str, dict[str, Any]]]:
    """The packs to export (``published_packs``) once every refusal passed: ExportRefused
    for an untrainable pack or a DEST that is not empty."""
    packs = published_packs(ctx.output, ctx.storage, splits)
    for _, manifest in packs.values():
        refuse_untrainable(manifest)
    refuse_non_empty(fs.normalize_uri(dest).rstrip("/"), ctx.storage)
    return packs


def published_packs(
    output: str, storage: fs.Storage, splits: list[str] | None
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Energon split → (pack root, manifest) of the published packs to export: ``train`` and,
    when the run has one, ``val`` (its evaluation pack); or the ``splits`` asked for."""
    root = schemas.packed_uri(output)
    try:
        manifest = schemas.load_manifest(schemas.manifest_uri(output), storage)
    except schemas.ManifestError as err:
        raise ExportRefused(f"{err}; export needs a published pack under {output}") from err
    have = ["train", "val"] if manifest.get("eval") else ["train"]
    wanted = splits or have
    for split in wanted:
        if split not in SPLITS:
            raise ExportRefused(f"unknown split {split!r}: Energon splits are {', '.join(SPLITS)}")
        if split not in have:
            raise ExportRefused(
                f"the pack under {output} has no {SPLITS[split]} split to export as {split!r} (it has: "
                f"{', '.join(have)}); set eval.fraction or datasets[].eval_samples and re-run pack"
            )
    packs = {"train": (root, manifest)} if "train" in wanted else {}
    if "val" in wanted:  # the evaluation pack the training manifest names (loader.dataset's rule)
        from loader.dataset import load_split
        from loader.source import ShardError

        try:
            packs["val"] = (schemas.packed_eval_uri(output), load_split(root, "eval", storage))
        except ShardError as err:
            raise ExportRefused(str(err)) from err
    return packs


def first(packs: Mapping[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The manifest the export's profile and settings come from (its packs share them)."""
    return next(iter(packs.values()))[1]


def refuse_untrainable(manifest: Mapping[str, Any]) -> None:
    """ExportRefused for a pack Megatron-Core's THD batches would not train exactly: its
    family's bins (``loader.megatron.unexpressible``), its preference pairs, or per-sample loss
    weights (Megatron's loss divides by the loss mask's sum: a weight there would re-average)."""
    from loader.megatron import unexpressible

    if manifest.get("preference"):
        raise ExportRefused(
            "this pack holds preference pairs (DPO); the Energon export feeds Megatron-Core's SFT "
            "batches: train pairs with loader.trainer.PackedDPOTrainer"
        )
    weighted = manifest["totals"].get("weighted_samples", 0)
    if weighted:
        raise ExportRefused(
            f"{weighted} samples carry a loss weight other than 1; Megatron-Core's loss has no "
            "per-sample weight: train them with the torch loader (loader.training.summed_loss)"
        )
    reason = unexpressible(manifest["config"]["profiles"][manifest["profile"]])
    if reason:
        raise ExportRefused(f"profile {manifest['profile']!r}: {reason}")


def refuse_non_empty(dest: str, storage: fs.Storage) -> None:
    """ExportRefused when DEST holds anything: an export never mixes with other files."""
    filesystem, path = storage.filesystem(dest)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise ExportRefused(f"{dest} is a file; --to takes a folder, empty or not yet there")
    if info.type == pafs.FileType.Directory:
        found = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
        if found:
            raise ExportRefused(
                f"{dest} is not empty ({len(found)} entries, e.g. {found[0].path}); export into an empty "
                "or new folder"
            )


# -- Spark: one shard → one tar ----------------------------------------------------------
def write_tars(batches: Iterator[pa.RecordBatch], dest: str, storage: fs.Storage) -> Iterator[pa.RecordBatch]:
    """Spark task: write the tar of each shard entry; emit what it wrote (JSON)."""
    for batch in batches:
        for entry in map(json.loads, batch.column("entry").to_pylist()):
            written = write_tar(entry, dest, storage)
            yield pa.record_batch([pa.array([json.dumps(written)], pa.string())], schema=WRITTEN)


def write_tar(entry: Mapping[str, Any], dest: str, storage: fs.Storage) -> dict[str, Any]:
    """One shard's bins as the tar ``entry["tar"]`` under ``dest``: its figures and sha256."""
    data = storage.read_bytes(entry["uri"])
    sha256 = hashlib.sha256(data).hexdigest()
    if len(data) != entry["bytes"] or sha256 != entry["sha256"]:
        raise MmpackError(
            f"shard {entry['uri']} does not match its manifest ({len(data)} bytes, sha256 {sha256}; "
            f"manifest: {entry['bytes']} bytes, {entry['sha256']}): it changed after pack published it"
        )
    shard = pq.ParquetFile(io.BytesIO(data))
    figures = {"bins": 0, "samples": 0, "tokens": 0}
    with storage.atomic_output(fs.join(dest, entry["tar"])) as stream:
        digest = fs.HashingSink(stream)
        with tarfile.open(fileobj=digest, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for group in range(shard.num_row_groups):
                table = shard.read_row_group(group).combine_chunks()
                for row in range(table.num_rows):
                    key = f"{entry['split']}-{entry['shard']:05d}-{figures['bins']:06d}"
                    came_from = ("split", "shard", "profile", "profile_digest")
                    location = {field: entry[field] for field in came_from} | {"row": figures["bins"]}
                    for name, payload in bin_members(table, row, location, storage):
                        _add(tar, f"{key}.{name}", payload)
                    figures["bins"] += 1
                    figures["samples"] += len(table["sample_ids"][row])
                    figures["tokens"] += table["num_tokens"][row].as_py()
    return {"path": entry["tar"], **figures, "bytes": digest.size, "sha256": digest.hexdigest()}


def bin_members(
    table: pa.Table, row: int, location: Mapping[str, Any], storage: fs.Storage
) -> Iterator[tuple[str, bytes]]:
    """The tar parts of one bin (``TAR_PARTS``): the json (every column but the token arrays and
    the media bytes, with where the bin came from), the token arrays as int32 .npy, and each
    media item's bytes (read from its uri where the pack only references it)."""
    record = {name: table[name][row].as_py() for name in table.column_names if name not in (*ARRAYS, "media")}
    media = schemas.shared_media_data(table["media"][row].as_py())
    record["media"] = [{k: v for k, v in m.items() if k != "data"} for m in media]
    record["mmpack"] = dict(location)
    yield "json", json.dumps(record, sort_keys=True).encode()
    for name in ARRAYS:
        yield f"{name}.npy", _npy(table[name][row].values.to_numpy(zero_copy_only=False))
    for index, item in enumerate(media):
        yield f"{index}.media", item["data"] if item["data"] is not None else storage.read_bytes(item["uri"])


def _npy(values: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(values, dtype=np.int32), allow_pickle=False)
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    """A member with no time, owner or mode of its own: the same bytes on every machine."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(payload), 0o644, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(payload))


# -- driver: reconcile, prepare, publish -----------------------------------------------------
def reconcile(packs: Mapping[str, tuple[str, Mapping[str, Any]]], tars: list[dict[str, Any]]) -> None:
    """Every bin and sample of each exported pack is in its split's tars, once per shard."""
    problems = []
    for split, (_, manifest) in packs.items():
        mine = [t for t in tars if t["path"].startswith(f"{split}/")]
        found = {key: sum(t[key] for t in mine) for key in ("bins", "samples", "tokens")}
        expected = {
            "bins": manifest["totals"]["bins"],
            "samples": manifest["totals"]["samples"],
            "tokens": manifest["totals"]["tokens"],
        }
        if len(mine) != len(manifest["shards"]) or found != expected:
            problems.append(
                f"{split}: {len(mine)} tars with {found}, the manifest has "
                f"{len(manifest['shards'])} shards with {expected}"
            )
    if problems:
        raise ReconciliationError("the export does not account for its pack: " + "; ".join(problems))


def prepare(dest: str, tar_paths: list[str], storage: fs.Storage) -> None:
    """Energon's own preparation of the tars under ``dest``: ``.nv-meta`` and the ``.tar.idx``
    files, by one indexing process (so the index's bytes are the same every time)."""
    if not fs.is_s3(dest):
        _prepare_local(storage.filesystem(dest)[1], tar_paths)
        return
    with tempfile.TemporaryDirectory(prefix="mmpack-energon-") as local:
        for path in tar_paths:
            os.makedirs(os.path.dirname(os.path.join(local, path)), exist_ok=True)
            _download(storage, fs.join(dest, path), os.path.join(local, path))
        _prepare_local(local, tar_paths)
        for folder, _, names in os.walk(local):
            for name in names:
                relative = os.path.relpath(os.path.join(folder, name), local)
                if relative.startswith(".nv-meta/") or relative.endswith(".tar.idx"):
                    with open(os.path.join(local, relative), "rb") as f:
                        storage.write_bytes(fs.join(dest, relative), f.read())


def _prepare_local(root: str, tar_paths: list[str]) -> None:
    from megatron.energon.flavors import BaseWebdatasetFactory

    patterns = [
        (split, rf"^{split}/.*") for split in SPLITS if any(p.startswith(f"{split}/") for p in tar_paths)
    ]
    BaseWebdatasetFactory.prepare_dataset(
        root,
        tar_paths,
        split_parts_patterns=patterns,
        shuffle_seed=None,
        workers=1,
        progress_fn=lambda items, total=None: items,
    )
    with open(os.path.join(root, ".nv-meta", "dataset.yaml"), "w") as f:
        f.write(DATASET_YAML)


def _download(storage: fs.Storage, uri: str, path: str, chunk_bytes: int = 8 << 20) -> None:
    filesystem, remote = storage.filesystem(uri)
    with filesystem.open_input_stream(remote) as source, open(path, "wb") as target:
        while chunk := source.read(chunk_bytes):
            target.write(chunk)


def write_index_files(dest: str, manifest: Mapping[str, Any], storage: fs.Storage) -> None:
    """``index.uuid`` from the content (Energon writes a random one; nothing in 7.4 reads it)."""
    content = json.dumps([manifest["source"], manifest["splits"]], sort_keys=True)
    storage.write_bytes(
        fs.join(dest, ".nv-meta", "index.uuid"), str(uuid.uuid5(uuid.NAMESPACE_URL, content)).encode()
    )


def export_manifest(
    packs: Mapping[str, tuple[str, Mapping[str, Any]]],
    tars: list[dict[str, Any]],
    output: str,
    storage: fs.Storage,
) -> dict[str, Any]:
    """What the export holds and where it came from: the task encoder's profile, the source
    packs (run ids, manifest and shard sha256s) and every tar with its figures."""
    import megatron.energon

    train = first(packs)
    return {
        "format": schemas.EXPORT_FORMAT,
        "format_version": schemas.EXPORT_FORMAT_VERSION,
        "energon_version": getattr(megatron.energon, "__version__", "unknown"),
        "tar_parts": TAR_PARTS,
        "profile": train["profile"],
        "profile_settings": train["config"]["profiles"][train["profile"]],
        "media_encoding": train.get("media_encoding", "file"),
        "source": {
            "output": output,
            "packs": {
                split: {
                    "run_id": m["run_id"],
                    "manifest_sha256": storage.sha256_of(fs.join(root, schemas.MANIFEST_NAME))[0],
                    "shards": [{"path": s["path"], "sha256": s["sha256"]} for s in m["shards"]],
                }
                for split, (root, m) in packs.items()
            },
        },
        "splits": {
            split: {
                "bins": sum(t["bins"] for t in mine),
                "samples": sum(t["samples"] for t in mine),
                "tokens": sum(t["tokens"] for t in mine),
                "tars": mine,
            }
            for split in packs
            for mine in [[t for t in tars if t["path"].startswith(f"{split}/")]]
        },
    }


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def format_summary(dest: str, manifest: Mapping[str, Any], seconds: float) -> str:
    parts = [
        f"{split}: {s['bins']} bins, {s['samples']} samples in {len(s['tars'])} tars"
        for split, s in manifest["splits"].items()
    ]
    return f"export energon: {'; '.join(parts)} → {dest} ({seconds:.1f} s)"
