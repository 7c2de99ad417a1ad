"""The normalize stage: ShareGPT files + media → Delta ``samples`` and ``quarantine``.

input files ──plan (driver)──▶ splits ──read (tasks)──▶ raw records
    ──normalize (tasks: parse, validate, resolve + probe media)──▶ sample | quarantine
    samples: sorted runs (files) ──merged by id range, deduped (tasks)──▶ Delta samples
    quarantine rows (Spark) ──────────────────────────────────────────▶ Delta quarantine
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
from mmpack_udfs.normalize import datasets, inputs, records, sample_runs

log = logging.getLogger(__name__)

REPORT_NAME = "normalize.json"
RUNS_DIR = "_sample_runs"  # under OUT/tables: the samples' sorted runs while a run writes them


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
    runs_dir = fs.join(ctx.output, "tables", RUNS_DIR)
    _remove(runs_dir, storage)  # a killed run's
    normalized = _normalized_rows(spark, splits, specs, settings, storage, tasks, runs_dir)
    common = {"run_id": run_id, "mode": ctx.mode, "storage": storage}
    try:
        counts = _counts(normalized)
        run_files = sorted({r["run"] for r in counts if r["kind"] == schemas.ROW_KIND_RUN})
        valid = sum(r["samples"] for r in counts if r["kind"] == schemas.ROW_KIND_RUN)
        quarantined = sum(r["rows"] for r in counts if r["kind"] == schemas.ROW_KIND_QUARANTINE)
        existing = _existing_files(samples_uri, ctx.mode, storage)
        written, kept = sample_runs.write_samples(
            spark, run_files, valid, samples_uri, rows_per_file=config.normalize.rows_per_file,
            existing=existing, **common,
        )  # fmt: skip
        quarantine = tables.write_table(
            normalized.filter(f"kind = '{schemas.ROW_KIND_QUARANTINE}'"),
            quarantine_uri,
            schemas.QUARANTINE,
            sort_by=["dataset", "source_file", "source_position"],
            rows_per_file=config.normalize.rows_per_file,
            rows=quarantined,
            **common,
        )
    finally:
        normalized.unpersist()
    _remove(runs_dir, storage)
    summary = build_summary(run_id, ctx.output, counts, kept, written, quarantine, len(files), len(splits))
    summary["seconds"] = round(time.time() - started, 2)
    reconcile(summary)
    runs.publish_summary(ctx, REPORT_NAME, summary, format_summary)
    return summary


def _normalized_rows(spark, splits, specs, settings, storage, tasks: int, runs_dir: str):
    """The NORMALIZED DataFrame (a row per quarantined record, per split and per run of
    samples written under ``runs_dir``), persisted on disk."""
    from pyspark import StorageLevel
    from pyspark.sql.pandas.types import from_arrow_schema

    split_df = one_task_per_row(spark, inputs.splits_table(splits))
    normalize = partial(records.normalize_batches, specs=specs, settings=settings, storage=storage)
    as_runs = partial(records.samples_as_runs, normalize=normalize, runs_dir=runs_dir, storage=storage)
    read = partial(inputs.read_splits_batches, storage=storage, specs=specs)
    if len(splits) >= tasks:  # every core has several splits: normalize where they are read
        normalized = split_df.mapInArrow(
            releasing(partial(records.read_and_normalize, read=read, normalize=as_runs)),
            from_arrow_schema(schemas.NORMALIZED),
        )
    else:
        raw = split_df.mapInArrow(releasing(read), from_arrow_schema(inputs.RAW))
        normalized = raw.repartition(tasks, "source_file", "source_position").mapInArrow(
            releasing(as_runs), from_arrow_schema(schemas.NORMALIZED)
        )
    return normalized.persist(StorageLevel.DISK_ONLY)


def _counts(normalized) -> list[dict]:
    """In one Spark job: the rows, records read and samples per kind, dataset and reason; per
    run file for the runs (``run``)."""
    from pyspark.sql import functions as F

    run = F.when(F.col("kind") == schemas.ROW_KIND_RUN, F.col("source_file")).alias("run")
    grouped = normalized.groupBy("kind", "dataset", "reason", run).agg(
        F.count("*").alias("rows"), F.sum("records_read").alias("read"), F.sum("samples").alias("samples")
    )
    return [r.asDict() for r in grouped.collect()]


def _existing_files(samples_uri: str, mode: str, storage: fs.Storage) -> list[str]:
    """The samples table's files whose ids an append leaves out (none for an overwrite)."""
    if mode != "append" or tables.open_table(samples_uri, storage) is None:
        return []
    return tables.data_files(samples_uri, storage)[1]


def _remove(folder: str, storage: fs.Storage) -> None:
    if storage.exists(folder):
        storage.delete_dir(folder)


def build_summary(run_id, output, counts, kept, samples, quarantine, n_files, n_splits) -> dict:
    """Counts per dataset and per reason; duplicates = valid samples not kept."""
    datasets: dict[str, dict[str, Any]] = {}
    for row in counts:
        d = datasets.setdefault(row["dataset"], {"read": 0, "valid": 0, "quarantined": 0, "reasons": {}})
        if row["kind"] == schemas.ROW_KIND_SPLIT:
            d["read"] += row["read"] or 0
        elif row["kind"] == schemas.ROW_KIND_RUN:
            d["valid"] += row["samples"]
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
