"""The packing report: how well the bins are filled and how evenly they cost, from the shards.

``mmpack report --out OUT`` (and the pack job) read manifest.json and the shards' per-bin
figure columns and media kinds (never the tokens or pixels) and write
``OUT/report/pack.json``, the PNG plots (``report.plots``) and ``OUT/report/index.html``
(``report.html``: the numbers, the plots and the quarantine reasons with examples).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs, tables
from mmpack_udfs.pack import costs
from mmpack_udfs.report import html, plots

REPORT_NAME = "pack.json"
STAGE_REPORTS = ("normalize", "tokenize", "pack_skipped", "validate")  # OUT/report/<name>.json
EXAMPLES_PER_REASON = 3


class ReportError(MmpackError, RuntimeError):
    """There is no published packing to report on."""


def read_manifest(output: str, storage: fs.Storage = fs.LOCAL) -> dict[str, Any]:
    try:
        return schemas.load_manifest(schemas.manifest_uri(output), storage)
    except schemas.ManifestError as err:
        raise ReportError(str(err)) from err


def read_figures(output: str, manifest: Mapping[str, Any], storage: fs.Storage = fs.LOCAL) -> pa.Table:
    """Per-bin figure columns and cu_seqlens of every shard, in manifest order."""
    root = schemas.packed_uri(output)
    columns = [*schemas.SHARD_FIGURES, "cu_seqlens"]
    parts = []
    for shard in manifest["shards"]:
        filesystem, path = storage.filesystem(fs.join(root, shard["path"]))
        with filesystem.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            media = schemas.nested_field_paths(parquet.schema, "media", ["sample_index", "kind"])
            parts.append(parquet.read(columns=columns + media))
    if parts:
        return pa.concat_tables(parts)
    media_type = pa.list_(pa.struct([("sample_index", pa.int32()), ("kind", pa.string())]))
    empty = pa.schema([*(schemas.SHARD.field(c) for c in columns), pa.field("media", media_type)])
    return empty.empty_table()


def statistics(manifest: Mapping[str, Any], figures: pa.Table) -> dict[str, Any]:
    """Fill, bins vs the lower bound, samples per bin, token shares and attention-cost spread."""
    budget, totals = manifest["budget"], manifest["totals"]
    tokens = figures.column("num_tokens").to_numpy().astype(np.int64)
    bins, total = len(tokens), int(tokens.sum())
    lower_bound = -(-total // budget)
    if not bins:
        return {"bins": 0, "tokens": 0, "samples": 0, "budget": budget, "skipped": totals["skipped"]}
    samples = figures.column("num_samples").to_numpy()
    cost = figures.column("sum_sq_lengths").to_numpy().astype(np.float64)
    image, video = (int(pc.sum(figures.column(c)).as_py()) for c in ("image_tokens", "video_tokens"))
    return {
        "budget": budget,
        "bins": bins,
        "lower_bound_bins": lower_bound,
        "extra_bins": bins - lower_bound,
        "tokens": total,
        "samples": int(samples.sum()),
        "skipped": totals["skipped"],
        "fill": round(total / (bins * budget), 6),
        "fill_of_lower_bound": round(lower_bound / bins, 6),
        "samples_per_bin": _spread(samples),
        "tokens_per_bin": _spread(tokens),
        "token_share": {
            "text": round((total - image - video) / total, 6),
            "image": round(image / total, 6),
            "video": round(video / total, 6),
        },
        "supervised_share": round(int(pc.sum(figures.column("supervised_tokens")).as_py()) / total, 6),
        "attention_cost": {  # sum of squared sample lengths per bin
            **_spread(cost),
            "max_over_mean": round(float(cost.max() / cost.mean()), 4),
            "cv": round(float(cost.std() / cost.mean()), 4),
        },
        "vision_patches_per_bin": _spread(figures.column("vision_patches").to_numpy()),
    }


def _spread(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": round(float(values.mean()), 2),
        "min": float(values.min()),
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def write_report(output: str, storage: fs.Storage = fs.LOCAL) -> dict[str, Any]:
    """Compute, write (JSON, PNGs and index.html under OUT/report) and print the packing report."""
    manifest = read_manifest(output, storage)
    figures = read_figures(output, manifest, storage)
    summary = {
        "stage": "pack",
        "run_id": manifest["run_id"],
        "manifest": schemas.manifest_uri(output),
        "source": manifest["source"],
        "shards": manifest["totals"]["shards"],
        "bytes": manifest["totals"]["bytes"],
        "bytes_per_token": round(manifest["totals"]["bytes"] / max(manifest["totals"]["tokens"], 1), 3),
        "media": _media_kind(manifest),
        **statistics(manifest, figures),
        "mix": manifest.get("mix", {}),
        "eval": manifest.get("eval"),
        "preference": manifest.get("preference", False),
    }
    storage.write_bytes(schemas.report_uri(output, REPORT_NAME), json.dumps(summary, indent=2).encode())
    stages = _stage_reports(output, storage)
    pngs: dict[str, bytes] = {}
    if figures.num_rows:
        pngs = plots.bin_plots(figures, manifest, _over_length(stages, manifest))
        if "cost_index" in manifest:
            index = costs.read_index(schemas.packed_uri(output), manifest, storage)
            pngs[plots.COST_PLOT] = plots.cost_plot(index, manifest)
        for name, png in pngs.items():
            storage.write_bytes(schemas.report_uri(output, name), png)
    examples = {
        table: quarantine_examples(schemas.table_uri(output, table), storage)
        for table in ("quarantine", "tokenize_quarantine")
    }
    links = [REPORT_NAME, *(f"{stage}.json" for stage in stages), *pngs, "../packed/manifest.json"]
    page = html.render(summary, stages, pngs, examples, links)
    storage.write_bytes(schemas.report_uri(output, html.PAGE_NAME), page.encode())
    print(format_report(summary))
    return summary


def _stage_reports(output: str, storage: fs.Storage) -> dict[str, Any]:
    """The other stages' JSON reports that exist, by stage name (``<stage>.json``)."""
    found: dict[str, Any] = {}
    for stage in STAGE_REPORTS:
        uri = schemas.report_uri(output, f"{stage}.json")
        if storage.exists(uri):
            found[stage] = json.loads(storage.read_bytes(uri))
    return found


def _over_length(stages: Mapping[str, Any], manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What did not fit as it was: dropped (too_long), truncated or split, skipped by pack."""
    tokenize = stages.get("tokenize", {})
    return {
        "max_tokens": tokenize.get("max_tokens", manifest["budget"]),
        "policy": tokenize.get("over_length", "drop"),
        "dropped": tokenize.get("reasons", {}).get("too_long", 0),
        "over_length": tokenize.get("counts", {}).get("over_length", 0),
        "skipped": manifest["totals"]["skipped"],
    }


def quarantine_examples(uri: str, storage: fs.Storage, per_reason: int = EXAMPLES_PER_REASON) -> dict:
    """Up to ``per_reason`` rows of a quarantine table for each reason, in table order; the
    reasons are read first, whole rows only for the ones kept."""
    if not storage.exists(fs.join(uri, "_delta_log")):
        return {}
    examples: dict[str, list[dict]] = {}
    chosen: Counter[str] = Counter()
    for file in tables.snapshot(uri, storage).files:
        filesystem, path = storage.filesystem(file)
        reasons = pq.read_table(path, columns=["reason"], filesystem=filesystem).column("reason").to_pylist()
        wanted = []
        for row, reason in enumerate(reasons):
            if chosen[reason] < per_reason:
                chosen[reason] += 1
                wanted.append(row)
        if wanted:
            for record in pq.read_table(path, filesystem=filesystem).take(wanted).to_pylist():
                examples.setdefault(record["reason"], []).append(record)
    return examples


def _media_kind(manifest: Mapping[str, Any]) -> str:
    """How the shards hold media: the original files, prepared 8-bit patches, or URIs only."""
    if not manifest.get("media_embedded", True):
        return "referenced by URI"
    return (
        "prepared (8-bit patches at their grid)"
        if manifest.get("media_encoding") == "patches8"
        else "original files"
    )


def format_report(s: Mapping[str, Any]) -> str:
    lines = [f"pack  run {s['run_id']}  budget {s['budget']:,} tokens"]
    if not s["bins"]:
        return "\n".join([*lines, "  no bins (no tokenized rows)"])
    share = s["token_share"]
    cost = s["attention_cost"]
    lines += [
        f"  {s['samples']:,} samples → {s['bins']:,} bins in {s['shards']} shard(s), "
        f"{s['bytes'] / 2**20:,.1f} MiB ({s['bytes_per_token']} bytes per token; media {s['media']})"
        + (f"; {s['skipped']} skipped as over budget" if s["skipped"] else ""),
        f"  fill {100 * s['fill']:.2f} %  (bins {s['bins']:,} vs lower bound {s['lower_bound_bins']:,}: "
        f"+{s['extra_bins']})",
        f"  samples per bin: mean {s['samples_per_bin']['mean']}, min {s['samples_per_bin']['min']:.0f}, "
        f"max {s['samples_per_bin']['max']:.0f}",
        f"  tokens {s['tokens']:,}: text {100 * share['text']:.1f} %, image {100 * share['image']:.1f} %, "
        f"video {100 * share['video']:.1f} %; supervised {100 * s['supervised_share']:.1f} %",
        f"  attention cost (sum of l² per bin): max/mean {cost['max_over_mean']}, cv {cost['cv']}",
        f"  manifest: {s['manifest']}",
    ]
    if s.get("preference"):
        lines.insert(2, f"  preference pairs: {s['samples'] // 2:,}, each side by side in one bin")
    if s.get("eval"):
        e = s["eval"]
        lines.append(
            f"  evaluation split: {e['samples']:,} samples in {e['bins']:,} bins ({e['tokens']:,} tokens)"
        )
    mixed = {
        name: d
        for name, d in s.get("mix", {}).items()
        if d["train_copies"] != d["rows"] - d["over_budget_rows"]
    }
    for name, d in mixed.items():
        lines.append(
            f"  mix {name}: {d['samples']:,} samples → train {d['train_samples']:,} "
            f"({d['train_copies']:,} rows with copies, {d['train_tokens']:,} tokens), "
            f"eval {d['eval_samples']:,}, left out {d['dropped_rows']:,} rows"
        )
    return "\n".join(lines)
