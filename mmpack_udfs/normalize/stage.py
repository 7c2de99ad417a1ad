"""The normalize stage: ShareGPT files + media → Delta ``samples`` and ``quarantine``.

input files ──plan (driver)──▶ splits ──read (tasks)──▶ raw records
    ──normalize (tasks: parse, validate, resolve + probe media)──▶ sample | quarantine
    ──dedupe by sample_id (in the write's own shuffle)──▶ Delta samples        Delta quarantine
    ──reconcile: read = samples + quarantined + duplicates──▶ report/normalize.json

A task reads its split and normalizes what it read when there are enough splits to keep every
core busy (JSONL cut into several byte ranges a core); otherwise (a few JSON arrays, Parquet
row groups or tars) the raw records are shuffled over the cores first, which spreads the media
probing of one large split.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict
from functools import partial
from typing import Any

from mmpack_udfs import runs, schemas
from mmpack_udfs.config import Config, config_hash
from mmpack_udfs.context import RunContext
from mmpack_udfs.errors import ReconciliationError
from mmpack_udfs.io import fs, tables
from mmpack_udfs.io.memory import releasing
from mmpack_udfs.io.spark import one_task_per_row
from mmpack_udfs.normalize import datasets, inputs, records

log = logging.getLogger(__name__)

REPORT_NAME = "normalize.json"
FIRST_BY = ("dataset", "source_file", "source_position")  # which of a sample_id's rows is kept
KEPT = "kept"  # the counts job's rows of samples kept per dataset (not a row kind of NORMALIZED)


def derive_run_id(config: Config, files: list[inputs.InputFile]) -> str:
    """A run id from the config and the input files' names, sizes and modification times."""
    listing = [[f.dataset, f.uri, f.size, f.mtime_ns] for f in files]
    return runs.run_id_from("normalize", {"config": config_hash(config), "files": listing})


def run(spark, ctx: RunContext) -> dict[str, Any]:
    """Run the stage; return (and write, and print) the summary. Raises on reconciliation."""
    started = time.time()
    config, storage = ctx.config, ctx.storage
    specs = datasets.specs_of(config.datasets, storage)
    files = inputs.list_inputs(list(specs.values()), storage)
    run_id = ctx.run_id or derive_run_id(config, files)
    samples_uri, quarantine_uri = ctx.table("samples"), ctx.table("quarantine")

    previous = runs.previous_summary(ctx, REPORT_NAME, run_id, [samples_uri, quarantine_uri])
    if previous is not None:
        log.info("normalize: run %s is already committed; nothing to do", run_id)
        print(format_summary(previous))
        return previous

    settings = records.NormalizeSettings.from_config(
        config.normalize, fs.join(ctx.output, "media"), config.tokenize.use_audio_in_video
    )
    tasks = max(spark.sparkContext.defaultParallelism * 2, 1)
    split_bytes = inputs.jsonl_split_bytes(files, config.normalize.split_bytes, tasks)
    splits = inputs.plan_splits(files, split_bytes, storage)
    normalized = _normalized_rows(spark, splits, specs, settings, storage, tasks)
    samples = _new_samples(spark, normalized, samples_uri, ctx.mode, storage)
    common = {
        "run_id": run_id,
        "mode": ctx.mode,
        "rows_per_file": config.normalize.rows_per_file,
        "storage": storage,
    }
    try:
        counts, kept = _counts(normalized, samples)
        quarantined = sum(r["rows"] for r in counts if r["kind"] == schemas.ROW_KIND_QUARANTINE)
        written = tables.write_table(
            samples,
            samples_uri,
            schemas.SAMPLES,
            sort_by=["sample_id"],
            first_by=FIRST_BY,
            rows=sum(kept.values()),
            **common,
        )
        quarantine = tables.write_table(
            normalized.filter(f"kind = '{schemas.ROW_KIND_QUARANTINE}'"),
            quarantine_uri,
            schemas.QUARANTINE,
            sort_by=["dataset", "source_file", "source_position"],
            rows=quarantined,
            **common,
        )
    finally:
        normalized.unpersist()
    summary = build_summary(run_id, ctx.output, counts, kept, written, quarantine, len(files), len(splits))
    summary["seconds"] = round(time.time() - started, 2)
    reconcile(summary)
    runs.publish_summary(ctx, REPORT_NAME, summary, format_summary)
    return summary


def _normalized_rows(spark, splits, specs, settings, storage, tasks: int):
    """The NORMALIZED DataFrame (one row per record + one per split), persisted on disk."""
    from pyspark import StorageLevel
    from pyspark.sql.pandas.types import from_arrow_schema

    split_df = one_task_per_row(spark, inputs.splits_table(splits))
    normalize = partial(records.normalize_batches, specs=specs, settings=settings, storage=storage)
    read = partial(inputs.read_splits_batches, storage=storage, specs=specs)
    if len(splits) >= tasks:  # every core has several splits: normalize where they are read
        normalized = split_df.mapInArrow(
            releasing(partial(records.read_and_normalize, read=read, normalize=normalize)),
            from_arrow_schema(schemas.NORMALIZED),
        )
    else:
        raw = split_df.mapInArrow(releasing(read), from_arrow_schema(inputs.RAW))
        normalized = raw.repartition(tasks, "source_file", "source_position").mapInArrow(
            releasing(normalize), from_arrow_schema(schemas.NORMALIZED)
        )
    return normalized.persist(StorageLevel.DISK_ONLY)


def _counts(normalized, samples) -> tuple[list[dict], dict[str, int]]:
    """In one Spark job: the rows (and records read) per kind, dataset and reason; and the
    samples kept per dataset, each sample_id counted once, for the dataset of its first row by
    ``FIRST_BY`` (the row the write keeps: only ids and source places are shuffled for it)."""
    from pyspark.sql import functions as F

    grouped = normalized.groupBy("kind", "dataset", "reason").agg(
        F.count("*").alias("rows"), F.sum("records_read").alias("read")
    )
    first = samples.groupBy("sample_id").agg(F.min(F.struct(*FIRST_BY)).alias("first"))
    kept = first.groupBy(F.col("first.dataset").alias("dataset")).agg(F.count("*").alias("rows"))
    kept = kept.select(
        F.lit(KEPT).alias("kind"), "dataset", F.lit(None).cast("string").alias("reason"), "rows",
        F.lit(None).cast("long").alias("read"),
    )  # fmt: skip
    rows = [r.asDict() for r in grouped.unionByName(kept).collect()]
    kept_per_dataset = {r["dataset"]: r["rows"] for r in rows if r["kind"] == KEPT}
    return [r for r in rows if r["kind"] != KEPT], kept_per_dataset


def _new_samples(spark, normalized, samples_uri, mode, storage):
    """The valid samples, duplicates included; in append mode only ids the table lacks."""
    samples = normalized.filter(f"kind = '{schemas.ROW_KIND_SAMPLE}'").select(*schemas.SAMPLES.names)
    if mode == "append" and tables.open_table(samples_uri, storage) is not None:
        existing = tables.read_table(spark, samples_uri, storage).select("sample_id")
        samples = samples.join(existing, "sample_id", "left_anti")
    return samples


def build_summary(run_id, output, counts, kept, samples, quarantine, n_files, n_splits) -> dict:
    """Counts per dataset and per reason; duplicates = valid samples not kept."""
    datasets: dict[str, dict[str, Any]] = {}
    for row in counts:
        d = datasets.setdefault(row["dataset"], {"read": 0, "valid": 0, "quarantined": 0, "reasons": {}})
        if row["kind"] == schemas.ROW_KIND_SPLIT:
            d["read"] += row["read"] or 0
        elif row["kind"] == schemas.ROW_KIND_SAMPLE:
            d["valid"] += row["rows"]
        else:
            d["quarantined"] += row["rows"]
            d["reasons"][row["reason"]] = d["reasons"].get(row["reason"], 0) + row["rows"]
    for name, d in datasets.items():
        d["samples"] = kept.get(name, 0)
        d["duplicates"] = d.pop("valid") - d["samples"]
        d["reasons"] = dict(sorted(d["reasons"].items()))
    totals = {
        k: sum(d[k] for d in datasets.values()) for k in ("read", "samples", "quarantined", "duplicates")
    }
    reasons: dict[str, int] = {}
    for d in datasets.values():
        for reason, n in d["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        "stage": "normalize",
        "run_id": run_id,
        "output": output,
        "input_files": n_files,
        "splits": n_splits,
        "totals": totals,
        "reasons": dict(sorted(reasons.items())),
        "datasets": dict(sorted(datasets.items())),
        "tables": {"samples": asdict(samples), "quarantine": asdict(quarantine)},
    }


def reconcile(summary: Mapping[str, Any]) -> None:
    """Fail loudly unless every record read is a sample, a quarantine row or a duplicate."""
    t = summary["totals"]
    written = {name: summary["tables"][name]["rows"] for name in ("samples", "quarantine")}
    problems = []
    if t["read"] != t["samples"] + t["quarantined"] + t["duplicates"]:
        problems.append(
            f"read {t['read']} != samples {t['samples']} + quarantined {t['quarantined']} "
            f"+ duplicates {t['duplicates']}"
        )
    if written["samples"] != t["samples"] or written["quarantine"] != t["quarantined"]:
        problems.append(f"tables hold {written}, counted {t['samples']} / {t['quarantined']}")
    if problems:
        raise ReconciliationError("normalize reconciliation failed: " + "; ".join(problems))


def format_summary(summary: Mapping[str, Any]) -> str:
    """The one-screen summary printed at the end of the stage."""
    t = summary["totals"]
    lines = [
        f"normalize  run {summary['run_id']}  ({summary.get('seconds', '?')} s, "
        f"{summary['input_files']} files, {summary['splits']} splits)",
        f"  {'dataset':<24}{'read':>10}{'samples':>10}{'quarantined':>13}{'duplicates':>12}",
    ]
    for name, d in [*summary["datasets"].items(), ("total", t)]:
        counts = f"{d['read']:>10}{d['samples']:>10}{d['quarantined']:>13}{d['duplicates']:>12}"
        lines.append(f"  {name:<24}{counts}")
    if summary["reasons"]:
        lines.append("  quarantine reasons:")
        lines += [f"    {reason:<28}{n:>8}" for reason, n in summary["reasons"].items()]
    for name, table in summary["tables"].items():
        state = "unchanged (already committed)" if table["skipped"] else "committed"
        lines.append(f"  {name}: {table['table']}  v{table['version']}  {table['rows']} rows, {state}")
    lines.append(
        f"  reconciled: read {t['read']} = samples {t['samples']} + quarantined "
        f"{t['quarantined']} + duplicates {t['duplicates']}"
    )
    return "\n".join(lines)
