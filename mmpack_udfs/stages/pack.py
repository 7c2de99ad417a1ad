"""The pack stage: Delta ``tokenized`` → Parquet packed shards + manifest.json + report.

    driver: lengths (3 int columns) → oversize check, number of groups
    Spark:  rows ──repartition(groups, sample_id)──▶ one task per packing group:
        sort its rows by sample_id → first-fit-decreasing → bins in cost-stratified row
        groups (costs.stratified_order) → write its shards
        (packed/shards/<run tag>/g<group>-<shard>.parquet)
    driver: reconcile (rows in = packed + skipped), write manifest.json last, report

A retried task rewrites identical files (names and content depend only on the rows of
its group and the config); a reader only ever opens what the manifest names.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import mmpack_udfs
from mmpack_udfs import costs, fs, report, schemas, shards, tables
from mmpack_udfs.config import config_hash
from mmpack_udfs.packing import first_fit_decreasing
from mmpack_udfs.stages import runs

REPORT_NAME = "pack.json"
SKIPPED_NAME = "pack_skipped.json"

SKIPPED = pa.struct(
    [("sample_id", pa.string()), ("num_tokens", pa.int64()), ("second", pa.int64()), ("reason", pa.string())]
)
WRITTEN = pa.struct(  # shards.WrittenShard
    [
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("samples", pa.int64()),
        ("tokens", pa.int64()),
        ("bytes", pa.int64()),
        ("sha256", pa.string()),
        ("row_groups", pa.int64()),
    ]
)
GROUP_RESULT = pa.schema(
    [
        ("group", pa.int32()),
        ("rows_in", pa.int64()),
        ("packed_rows", pa.int64()),
        ("bins", pa.int64()),
        ("shards", pa.list_(WRITTEN)),
        ("skipped", pa.list_(SKIPPED)),
        ("costs", pa.binary()),  # the group's cost index rows (costs.shard_rows), Arrow IPC
        ("seconds", pa.float64()),
    ]
)


class PackError(RuntimeError):
    """The pack job cannot run as configured (e.g. samples over the budget) or did not reconcile."""


@dataclass(frozen=True)
class PackSettings:
    budget: int
    second_by: str  # none | media_items | vision_patches
    second_budget: int | None
    oversize: str
    group_tokens: int
    bins_per_shard: int
    bins_per_row_group: int
    embed_media: bool
    seed: int
    profile: Mapping[str, Any]  # the model profile the rows were tokenized with
    cost_model: costs.CostModel  # orders the bins into cost-stratified row groups

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PackSettings:
        p = config["pack"]
        return cls(
            budget=p["budget"] or config["tokenize"]["max_tokens"],
            second_by=p["second_budget_by"],
            second_budget=p["second_budget"] if p["second_budget_by"] != "none" else None,
            oversize=p["oversize"],
            group_tokens=p["group_tokens"],
            bins_per_shard=p["bins_per_shard"],
            bins_per_row_group=p["bins_per_row_group"],
            embed_media=p["embed_media"],
            seed=p["seed"],
            profile=config["profiles"][config["tokenize"]["profile"]],
            cost_model=costs.CostModel.for_profile(config, config["tokenize"]["profile"]),
        )

    def second_sizes(self, rows: pa.Table) -> np.ndarray | None:
        """The second size of each row, or None without a second budget."""
        if self.second_by == "media_items":
            return shards.list_lengths(rows.column("media"))
        if self.second_by == "vision_patches":
            vision = rows.column("image_tokens").to_numpy() + rows.column("video_tokens").to_numpy()
            return vision.astype(np.int64) * shards.VISION_PATCHES_PER_TOKEN
        return None

    def oversize_mask(self, lengths: np.ndarray, second: np.ndarray | None) -> np.ndarray:
        too_big = lengths > self.budget
        if second is not None:
            too_big |= second > self.second_budget
        return too_big


def derive_run_id(config: Mapping[str, Any], tokenized_uri: str, version: int) -> str:
    profile = config["tokenize"]["profile"]
    facts = {
        "tokenized": [tokenized_uri, version],
        "pack": config["pack"],
        "tokenize": config["tokenize"],
        "cost_model": config["balance"]["cost_model"][profile],  # orders the bins
    }
    return runs.run_id_from("pack", facts)


def pack_groups(
    batches: Iterator[pa.RecordBatch],
    settings: PackSettings,
    packed_root: str,
    shard_dir: str,
    s3: fs.S3Options | None,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: pack the rows of this partition (one group) and write its shards."""
    from pyspark import TaskContext

    group = TaskContext.get().partitionId()
    received = list(batches)
    if received:  # an empty partition is a group that no sample_id hashed to
        rows = pa.Table.from_batches(received)
        yield pack_group(rows, group, settings, packed_root, shard_dir, s3)


def pack_group(
    rows: pa.Table,
    group: int,
    settings: PackSettings,
    packed_root: str,
    shard_dir: str,
    s3: fs.S3Options | None,
) -> pa.RecordBatch:
    """Pack one group's rows and write its shards; what was written and the shards' cost
    index rows, as one result row."""
    started = time.perf_counter()
    rows = rows.take(pc.sort_indices(rows, [("sample_id", "ascending")]))  # arrival order must not matter
    lengths = rows.column("num_tokens").to_numpy().astype(np.int64)
    second = settings.second_sizes(rows)
    packing = first_fit_decreasing(
        lengths,
        settings.budget,
        second=second,
        second_budget=settings.second_budget,
        oversize="skip",  # the driver has already failed the job if the policy is "error"
    )
    bin_order = cost_stratified_order(rows, packing.bin_of, packing.num_bins, group, settings)
    lay = shards.layout(packing.bin_of, lengths, bin_order)
    read_media = _media_reader(s3) if settings.embed_media else None
    written, cost_rows = [], []
    for number, first in enumerate(range(0, lay.num_bins, settings.bins_per_shard)):
        end = min(first + settings.bins_per_shard, lay.num_bins)
        batch = shards.build_bins(rows, lay, first, end, group=group, read_media=read_media)
        name = f"{shard_dir}/g{group:05d}-{number:05d}.parquet"
        written.append(
            asdict(shards.write_shard(packed_root, name, [batch], settings.bins_per_row_group, s3))
        )
        cost_rows.append(costs.shard_rows(pa.Table.from_batches([batch]), name, settings.profile))
    skipped_ids = rows.column("sample_id").take(pa.array(packing.skipped)).to_pylist()
    skipped = [
        {
            "sample_id": sid,
            "num_tokens": int(lengths[i]),
            "second": int(second[i]) if second is not None else 0,
            "reason": "over_budget" if lengths[i] > settings.budget else f"over_{settings.second_by}_budget",
        }
        for sid, i in zip(skipped_ids, packing.skipped, strict=True)
    ]
    result = {
        "group": group,
        "rows_in": rows.num_rows,
        "packed_rows": rows.num_rows - len(skipped),
        "bins": lay.num_bins,
        "shards": written,
        "skipped": skipped,
        "costs": costs.to_ipc(pa.concat_tables(cost_rows)) if cost_rows else None,
        "seconds": time.perf_counter() - started,
    }
    return pa.RecordBatch.from_pylist([result], schema=GROUP_RESULT)


def cost_stratified_order(
    rows: pa.Table, bin_of: np.ndarray, num_bins: int, group: int, settings: PackSettings
) -> np.ndarray:
    """The order to write the bins in (``bin_order[k]`` = the packer's bin written k-th):
    row groups stratified by cost (costs.stratified_order); bins of equal cost in a seeded
    order."""
    packed = bin_of >= 0

    def per_bin(values: np.ndarray) -> np.ndarray:
        return np.bincount(bin_of[packed], weights=values[packed].astype(np.float64), minlength=num_bins)

    tokens = rows.column("num_tokens").to_numpy().astype(np.int64)
    vision_tokens = rows.column("image_tokens").to_numpy() + rows.column("video_tokens").to_numpy()
    figures = {
        "tokens": per_bin(tokens),
        "sum_sq_lengths": per_bin(tokens * tokens),
        "vision_patches": per_bin(vision_tokens.astype(np.int64) * shards.VISION_PATCHES_PER_TOKEN),
        "vision_sq_patches": per_bin(
            costs.media_squares(rows.column("media").combine_chunks(), settings.profile)
        ),
    }
    vision, llm = settings.cost_model.phases(figures)
    tie = np.random.default_rng([settings.seed, group]).permutation(num_bins)
    return costs.stratified_order(costs.order_key(vision, llm), settings.bins_per_row_group, tie)


def _media_reader(s3: fs.S3Options | None):
    """Read a media file's bytes, once per file per task."""
    cache: dict[str, bytes] = {}

    def read(uri: str) -> bytes:
        if uri not in cache:
            cache[uri] = fs.read_bytes(uri, s3)
        return cache[uri]

    return read


def check_oversize(
    tokenized_uri: str, snap: tables.Snapshot, settings: PackSettings, s3: fs.S3Options | None
) -> tuple[int, int, list[str]]:
    """Rows and tokens in the table, and the ids of rows over a budget (reads count columns only).

    Raises PackError when any row is over a budget and the policy is ``error``, or when every
    row is (nothing would be published).
    """
    columns = ["sample_id", "num_tokens", "image_tokens", "video_tokens"]
    if settings.second_by == "media_items":
        columns.append("media")
    counts = tables.read_arrow(tokenized_uri, s3, columns=columns, snap=snap)
    lengths = counts.column("num_tokens").to_numpy().astype(np.int64)
    too_big = settings.oversize_mask(lengths, settings.second_sizes(counts))
    over = counts.column("sample_id").filter(pa.array(too_big)).to_pylist()
    if over and settings.oversize == "error":
        raise PackError(
            f"{len(over)} tokenized row(s) exceed the pack budget ({settings.budget} tokens"
            + (f", {settings.second_budget} {settings.second_by}" if settings.second_by != "none" else "")
            + f"), e.g. {', '.join(over[:5])}. Raise pack.budget (or tokenize with a smaller "
            "tokenize.max_tokens), or set pack.oversize=skip to leave them out."
        )
    if over and len(over) == counts.num_rows:  # an empty packing is a failed run, not a success
        raise PackError(
            f"every one of the {counts.num_rows} tokenized rows is over the pack budget ({settings.budget} "
            f"tokens), so nothing would be published. Raise pack.budget (the longest row has "
            f"{int(lengths.max())} tokens) or tokenize with a smaller tokenize.max_tokens."
        )
    return counts.num_rows, int(lengths.sum()), over


def published_run(packed_root: str, run_id: str, s3: fs.S3Options | None) -> dict | None:
    """The live manifest if it belongs to ``run_id`` and every shard it names is in place."""
    uri = fs.join(packed_root, schemas.MANIFEST_NAME)
    if not fs.exists(uri, s3):
        return None
    manifest = json.loads(fs.read_bytes(uri, s3))
    if manifest.get("run_id") != run_id:
        return None
    for shard in manifest["shards"]:
        info = fs.file_info(fs.join(packed_root, shard["path"]), s3)
        if info.size != shard["bytes"]:
            return None
    return manifest


def run(spark, config: Mapping[str, Any]) -> dict[str, Any]:
    """Run the stage; return (and write, and print) the summary. Raises PackError."""
    from pyspark.sql.pandas.types import from_arrow_schema

    started = time.time()
    s3 = fs.S3Options.from_config(config.get("s3"))
    output = fs.normalize_uri(config["output"])
    tokenized_uri = schemas.table_uri(output, "tokenized")
    packed_root = schemas.packed_uri(output)
    settings = PackSettings.from_config(config)
    snap = tables.snapshot(tokenized_uri, s3)  # one version for the checks, the read and the manifest
    run_id = config["run_id"] or derive_run_id(config, tokenized_uri, snap.version)

    if published_run(packed_root, run_id, s3) is not None:
        print(f"pack: run {run_id} is already published; nothing to do")
        return report.write_report(output, s3)

    rows_in, tokens_in, over = check_oversize(tokenized_uri, snap, settings, s3)
    groups = max(1, -(-tokens_in // settings.group_tokens))
    shard_dir = f"shards/{tables.run_tag(run_id)}"
    results: list[dict] = []
    if rows_in:
        df = tables.read_table(spark, tokenized_uri, s3, snap=snap).select(*shards.TOKENIZED_COLUMNS)
        task = partial(pack_groups, settings=settings, packed_root=packed_root, shard_dir=shard_dir, s3=s3)
        grouped = df.repartition(groups, "sample_id")
        results = [
            r.asDict(recursive=True)
            for r in grouped.mapInArrow(task, from_arrow_schema(GROUP_RESULT)).collect()
        ]
    tasks_done = time.time()
    results.sort(key=lambda r: r["group"])
    skipped = [s for r in results for s in r["skipped"]]
    reconcile(rows_in, len(over), results)
    manifest = build_manifest(config, settings, run_id, tokenized_uri, snap.version, results)
    manifest["cost_index"] = write_cost_index(packed_root, shard_dir, manifest, results, s3)
    fs.write_bytes(
        schemas.report_uri(output, SKIPPED_NAME), _json(sorted(skipped, key=lambda s: s["sample_id"])), s3
    )
    publish_manifest(packed_root, manifest, s3)
    summary = report.write_report(output, s3)
    summary["stage_seconds"] = {
        "tasks": round(tasks_done - started, 2),
        "total": round(time.time() - started, 2),
    }
    return summary


def reconcile(rows_in: int, oversize_rows: int, results: list[dict]) -> None:
    """rows in the table = rows read by the groups = rows in shards + rows skipped."""
    read = sum(r["rows_in"] for r in results)
    packed = sum(r["packed_rows"] for r in results)
    skipped = sum(len(r["skipped"]) for r in results)
    in_shards = sum(s["samples"] for r in results for s in r["shards"])
    problems = []
    if read != rows_in:
        problems.append(f"the groups read {read} rows but the table has {rows_in}")
    if read != packed + skipped or packed != in_shards:
        problems.append(f"rows read {read} != in shards {in_shards} + skipped {skipped}")
    if skipped != oversize_rows:
        problems.append(f"skipped {skipped} rows but {oversize_rows} are over budget")
    if problems:
        raise PackError("pack reconciliation failed: " + "; ".join(problems))


def build_manifest(
    config: Mapping[str, Any],
    settings: PackSettings,
    run_id: str,
    tokenized_uri: str,
    version: int,
    results: list[dict],
) -> dict[str, Any]:
    shard_list = sorted((s for r in results for s in r["shards"]), key=lambda s: s["path"])
    tokens = sum(s["tokens"] for s in shard_list)
    bins = sum(s["rows"] for s in shard_list)
    return {
        "format": schemas.SHARD_FORMAT,
        "format_version": schemas.SHARD_FORMAT_VERSION,
        "tool": {"name": "mmpack", "version": mmpack_udfs.__version__},
        "run_id": run_id,
        "source": {"table": tokenized_uri, "version": version},
        "profile": config["tokenize"]["profile"],
        "budget": settings.budget,
        "second_budget": {"by": settings.second_by, "max": settings.second_budget},
        "media_embedded": settings.embed_media,
        "bins_per_row_group": settings.bins_per_row_group,
        "totals": {
            "shards": len(shard_list),
            "bins": bins,
            "samples": sum(s["samples"] for s in shard_list),
            "tokens": tokens,
            "bytes": sum(s["bytes"] for s in shard_list),
            "skipped": sum(len(r["skipped"]) for r in results),
            "groups": len(results),
            "lower_bound_bins": -(-tokens // settings.budget),
            "fill": round(tokens / (bins * settings.budget), 6) if bins else 0.0,
        },
        "shards": shard_list,
        "config": config,
        "config_hash": config_hash(config),
    }


def write_cost_index(
    packed_root: str, shard_dir: str, manifest: Mapping[str, Any], results: list[dict], s3
) -> dict[str, Any]:
    """Write the run's per-bin cost index (rows the groups' tasks computed) beside its shards;
    the manifest entry naming it."""
    parts = [costs.from_ipc(r["costs"]) for r in results if r["costs"] is not None]
    data = costs.index_bytes(costs.assemble(parts, manifest["shards"]))
    path = f"{shard_dir}/{schemas.COST_INDEX_NAME}"
    fs.write_bytes(fs.join(packed_root, path), data, s3)
    return {"path": path, "rows": manifest["totals"]["bins"], "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


def publish_manifest(packed_root: str, manifest: Mapping[str, Any], s3: fs.S3Options | None) -> None:
    """Write manifest.json: the step that makes the run visible to readers (atomically)."""
    fs.write_bytes(fs.join(packed_root, schemas.MANIFEST_NAME), _json(manifest), s3)


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, default=str) + "\n").encode()
