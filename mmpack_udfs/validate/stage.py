"""The validate stage: check a published packing against its manifest and its source table.

    driver: manifest.json (format, version, totals = the sum of its shards)
    Spark:  one task per shard: size + sha256, Parquet schema, rows and row groups, and
            every bin's structure (lengths, cu_seqlens, labels, media spans, budget);
            emits the shard's sample ids
    driver: every sample of the manifest's source ``tokenized`` version is in exactly one
            bin or listed in report/pack_skipped.json, and nothing else is;
            write report/validate.json, print a summary, fail naming the problems

Run by ``mmpack validate`` and ``jobs/mmpack_job.py validate`` (the DAG's validate-shards task).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.constants import IGNORE_INDEX
from mmpack_udfs.context import RunContext
from mmpack_udfs.errors import MmpackError
from mmpack_udfs.io import fs, tables
from mmpack_udfs.io.memory import releasing
from mmpack_udfs.io.spark import one_task_per_row
from mmpack_udfs.pack import costs, mix
from mmpack_udfs.pack.shards import list_lengths, owner_of_elements
from mmpack_udfs.pack.stage import SKIPPED_NAME

REPORT_NAME = "validate.json"
EXAMPLES = 5  # bins or ids quoted per problem
MAX_PROBLEMS = 100  # problems kept in the report (the count is always exact)

MIX_COLUMNS = ["sample_id", "parent_id", "dataset"]  # what the mix is computed from (pack.mix.choose)
CHECKED = pa.schema([("shard", pa.string()), ("sample_id", pa.string()), ("problem", pa.string())])


class ValidationError(MmpackError, RuntimeError):
    """The published packing does not match its manifest or its source."""


def run(spark, ctx: RunContext) -> dict[str, Any]:
    """Validate ``OUT/packed`` (and ``OUT/packed-eval`` when the run has an evaluation split);
    write and print the summary. Raises ValidationError."""
    started = time.time()
    storage, output = ctx.storage, ctx.output
    manifest = _load(schemas.manifest_uri(output), storage)
    problems, packed_ids = check_pack(spark, schemas.packed_uri(output), manifest, storage)
    eval_ids, eval_manifest = None, None
    if manifest.get("eval"):
        eval_root = schemas.packed_eval_uri(output)
        eval_manifest = _load(fs.join(eval_root, schemas.MANIFEST_NAME), storage)
        eval_problems, eval_ids = check_pack(spark, eval_root, eval_manifest, storage)
        problems += [f"eval: {p}" for p in eval_problems + eval_manifest_problems(manifest, eval_manifest)]
    try:
        skipped, skipped_problems = read_skipped(output, manifest, storage)
        problems += skipped_problems
        source = source_problems(spark, manifest, packed_ids, eval_ids, skipped, storage)
        problems += source.pop("problems")
    finally:
        for ids in (packed_ids, eval_ids):
            if ids is not None:
                ids.unpersist()

    summary = {
        "manifest": schemas.manifest_uri(output),
        "run_id": manifest.get("run_id"),
        "shards": len(manifest["shards"]),
        "bins": manifest["totals"]["bins"],
        "samples": manifest["totals"]["samples"],
        "eval_samples": eval_manifest["totals"]["samples"] if eval_manifest else 0,
        "skipped": len(skipped),
        "bytes_hashed": sum(
            s["bytes"] for m in (manifest, eval_manifest or {"shards": []}) for s in m["shards"]
        ),
        "source": source,
        "ok": not problems,
        "problem_count": len(problems),
        "problems": problems[:MAX_PROBLEMS],
        "seconds": round(time.time() - started, 2),
    }
    storage.write_bytes(schemas.report_uri(output, REPORT_NAME), json.dumps(summary, indent=2).encode())
    print(format_summary(summary))
    if problems:
        shown = "\n  ".join(problems[:10])
        raise ValidationError(
            f"{len(problems)} problem(s) in {summary['manifest']} (all in "
            f"{schemas.report_uri(output, REPORT_NAME)}):\n  {shown}"
        )
    return summary


def _load(uri: str, storage: fs.Storage) -> dict[str, Any]:
    try:
        return schemas.load_manifest(uri, storage)
    except schemas.ManifestError as err:
        raise ValidationError(str(err)) from err


def check_pack(spark, packed_root: str, manifest: Mapping[str, Any], storage: fs.Storage):
    """Problems of one published pack (its manifest, cost index and every shard, one task per
    shard), and a persisted DataFrame of the sample ids in its shards (one row per copy)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    problems = manifest_problems(manifest)
    index, index_problems = read_cost_index(packed_root, manifest, storage)
    problems += index_problems
    entries = pa.array([json.dumps(e) for e in shard_entries(manifest, index)], pa.string())
    listing = one_task_per_row(spark, pa.table({"entry": entries}))
    profile = manifest["config"]["profiles"][manifest["profile"]]
    task = partial(
        check_shards, packed_root=packed_root, budget=manifest["budget"], storage=storage, profile=profile
    )
    checked = listing.mapInArrow(releasing(task), from_arrow_schema(CHECKED)).persist()
    problems += sorted(r.problem for r in checked.where("problem IS NOT NULL").collect())
    return problems, checked.where("sample_id IS NOT NULL").select("sample_id")


def eval_manifest_problems(manifest: Mapping[str, Any], eval_manifest: Mapping[str, Any]) -> list[str]:
    """The evaluation pack is the one the training manifest names."""
    named = manifest["eval"]
    found = {
        "run_id": eval_manifest.get("run_id"),
        **{k: eval_manifest["totals"][k] for k in ("bins", "samples", "tokens")},
    }
    return [
        f"manifest: the training manifest names {key} {named.get(key)}, the evaluation manifest has {value}"
        for key, value in found.items()
        if named.get(key) != value
    ]


def manifest_problems(manifest: Mapping[str, Any]) -> list[str]:
    """The totals must be the sums over the shards, and shard paths unique."""
    shards, totals = manifest["shards"], manifest["totals"]
    sums = {
        "shards": len(shards),
        "bins": sum(s["rows"] for s in shards),
        "samples": sum(s["samples"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
    }
    problems = [
        f"manifest: totals.{key} is {totals.get(key)} but its shards add up to {value}"
        for key, value in sums.items()
        if totals.get(key) != value
    ]
    if len({s["path"] for s in shards}) != len(shards):
        problems.append("manifest: a shard path is listed twice")
    return problems


def read_cost_index(
    packed_root: str, manifest: Mapping[str, Any], storage: fs.Storage
) -> tuple[pa.Table | None, list[str]]:
    """The cost index the manifest names, after its file checks (costs.read_index); its
    figures are checked against each shard by that shard's task. A packing made before the
    index has none: nothing to check."""
    if "cost_index" not in manifest:
        return None, []
    try:
        return costs.read_index(packed_root, manifest, storage), []
    except costs.CostIndexError as err:
        return None, [str(err)]


def shard_entries(manifest: Mapping[str, Any], index: pa.Table | None) -> list[dict]:
    """What each shard's task checks: its manifest entry, its number, and its cost index rows."""
    shard_of_row = index["shard"].to_numpy() if index is not None else None
    entries = []
    for number, shard in enumerate(manifest["shards"]):
        entry = {**shard, "number": number}
        if index is not None:
            rows = index.filter(pa.array(shard_of_row == number))
            entry["costs"] = {column: rows[column].to_pylist() for column in schemas.COST_INDEX_COLUMNS}
        entries.append(entry)
    return entries


def check_shards(
    batches: Iterator[pa.RecordBatch],
    packed_root: str,
    budget: int,
    storage: fs.Storage,
    profile: Mapping[str, Any],
) -> Iterator[pa.RecordBatch]:
    """Spark task: check the shards of its manifest entries; emit problems and sample ids."""
    for batch in batches:
        for entry in map(json.loads, batch.column("entry").to_pylist()):
            problems, sample_ids = check_shard(packed_root, entry, budget, storage, profile)
            n = len(problems) + len(sample_ids)
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([entry["path"]] * n, pa.string()),
                    pa.concat_arrays([pa.nulls(len(problems), pa.string()), sample_ids]),
                    pa.array(problems + [None] * len(sample_ids), pa.string()),
                ],
                schema=CHECKED,
            )


def check_shard(
    packed_root: str,
    entry: Mapping[str, Any],
    budget: int,
    storage: fs.Storage,
    profile: Mapping[str, Any] | None = None,
) -> tuple[list[str], pa.Array]:
    """Problems with one shard (named by its manifest entry, with its cost index rows when
    there is an index) and its sample ids."""
    uri, name = fs.join(packed_root, entry["path"]), entry["path"]
    no_ids = pa.array([], pa.string())
    try:
        data = storage.read_bytes(uri)  # read once: hashed, then decoded from memory
    except FileNotFoundError:
        return [f"{name}: missing"], no_ids
    except OSError as err:  # S3 reports a missing key as an OSError
        return [f"{name}: cannot be read: {err}"], no_ids
    size, sha256 = len(data), hashlib.sha256(data).hexdigest()
    if (size, sha256) != (entry["bytes"], entry["sha256"]):
        return [
            f"{name}: {size} bytes, sha256 {sha256}; the manifest says "
            f"{entry['bytes']} bytes, sha256 {entry['sha256']}"
        ], no_ids
    parquet = pq.ParquetFile(pa.BufferReader(data))
    if not schemas.is_shard_schema(parquet.schema_arrow):
        version = schemas.SHARD_FORMAT_VERSION
        return [f"{name}: its schema is not the shard schema of format version {version}"], no_ids
    bins = parquet.read()
    row_groups = parquet.num_row_groups
    problems = [f"{name}: {p}" for p in bin_problems(bins, budget)]
    found = {
        "rows": bins.num_rows,
        "row_groups": row_groups,
        "samples": int(pc.sum(bins["num_samples"]).as_py() or 0),
        "tokens": int(pc.sum(bins["num_tokens"]).as_py() or 0),
    }
    problems += [
        f"{name}: {key} is {value} but the manifest says {entry[key]}"
        for key, value in found.items()
        if value != entry[key]
    ]
    if entry.get("costs") is not None and profile is not None:
        problems += [f"{name}: {p}" for p in _cost_problems(bins, entry, profile)]
    return problems, pc.list_flatten(bins["sample_ids"]).combine_chunks()


def _cost_problems(bins: pa.Table, entry: Mapping[str, Any], profile: Mapping[str, Any]) -> list[str]:
    """The shard's rows of the cost index against the figures its bins give."""
    listed, actual = entry["costs"], costs.bin_costs(bins, entry["number"], profile)
    if len(listed["row"]) != actual.num_rows:
        return [f"cost_index: {len(listed['row'])} rows for this shard, which has {actual.num_rows} bins"]
    wrong = np.zeros(actual.num_rows, bool)
    for column in schemas.COST_INDEX_COLUMNS:
        wrong |= np.asarray(listed[column]) != actual[column].to_numpy()
    return [_describe("cost_index: figures differ from the shards", wrong)] if wrong.any() else []


def bin_problems(bins: pa.Table, budget: int) -> list[str]:
    """Structural problems of a shard's bins (pure, vectorized): each names its first bins."""
    tokens = bins["num_tokens"].to_numpy()
    samples = bins["num_samples"].to_numpy()
    length = {name: list_lengths(bins[name]) for name in ("input_ids", "labels", "cu_seqlens", "sample_ids")}
    bad = {
        "input_ids: length != num_tokens": length["input_ids"] != tokens,
        "labels: length != num_tokens": length["labels"] != tokens,
        "sample_ids: length != num_samples": length["sample_ids"] != samples,
        "cu_seqlens: length != num_samples + 1": length["cu_seqlens"] != samples + 1,
        "num_samples < 1": samples < 1,
        f"num_tokens over the budget ({budget})": tokens > budget,
    }
    if not any(mask.any() for mask in bad.values()):  # the flat checks need consistent lengths
        if "sample_datasets" in bins.column_names:
            bad["sample_datasets: length != num_samples"] = list_lengths(bins["sample_datasets"]) != samples
        bad["a sample twice in one bin (copies go to different bins)"] = _repeated_samples(bins)
        if "sample_weights" in bins.column_names:
            bad.update(_weight_problems(bins["sample_weights"], samples))
        if "sample_pair_sides" in bins.column_names:
            bad["sample_pair_sides: length != num_samples"] = (
                list_lengths(bins["sample_pair_sides"]) != samples
            )
            if not bad["sample_pair_sides: length != num_samples"].any():
                bad["a preference pair not side by side in one bin (chosen, then its rejected)"] = (
                    _broken_pairs(bins)
                )
        bad.update(_sequence_problems(bins, tokens))
        bad.update(_label_problems(bins))
        bad.update(_media_problems(bins, tokens))
    return [_describe(message, mask) for message, mask in bad.items() if mask.any()]


def _weight_problems(weights: pa.ChunkedArray, samples: np.ndarray) -> dict[str, np.ndarray]:
    """Bins whose sample weights are not one finite number >= 0 per sample."""
    wrong_length = list_lengths(weights) != samples
    if wrong_length.any():
        return {"sample_weights: length != num_samples": wrong_length}
    flat = pc.list_flatten(weights).to_numpy(zero_copy_only=False)
    bad_value = ~np.isfinite(flat) | (flat < 0)
    owner = owner_of_elements(samples)
    bad_bins = np.bincount(owner[bad_value], minlength=len(samples)) > 0
    return {"sample_weights: not a finite number >= 0": bad_bins}


def _repeated_samples(bins: pa.Table) -> np.ndarray:
    """Bins holding one sample id more than once."""
    flat = pa.table(
        {
            "bin": owner_of_elements(list_lengths(bins["sample_ids"])),
            "sample_id": pc.list_flatten(bins["sample_ids"]),
        }
    )
    pairs = flat.group_by(["bin", "sample_id"]).aggregate([([], "count_all")])
    repeated = np.zeros(bins.num_rows, bool)
    repeated[pairs["bin"].to_numpy()[pairs["count_all"].to_numpy() > 1]] = True
    return repeated


def _broken_pairs(bins: pa.Table) -> np.ndarray:
    """Bins where a pair side is not next to its other side: ``<id>-chosen`` must be followed,
    in the same bin, by ``<id>-rejected``, and a side's sample id must name that side."""
    ids = pc.list_flatten(bins["sample_ids"])
    sides = pc.list_flatten(bins["sample_pair_sides"])
    owner = owner_of_elements(list_lengths(bins["sample_ids"]))
    if not len(ids):
        return np.zeros(bins.num_rows, bool)
    chosen, rejected = (pc.fill_null(pc.equal(sides, side), False).to_numpy(zero_copy_only=False)
                        for side in schemas.PAIR_SIDES)  # fmt: skip
    paired = chosen | rejected
    pair_ids = pc.replace_substring_regex(ids, "-(chosen|rejected)$", "").to_numpy(zero_copy_only=False)
    named = pc.equal(ids, pc.binary_join_element_wise(pair_ids, pc.fill_null(sides, ""), "-"))
    wrong = paired & ~pc.fill_null(named, False).to_numpy(zero_copy_only=False)
    after = np.append(np.arange(1, len(ids)), 0)  # the next sample (wraps; checked by owner)
    partnered = rejected[after] & (owner[after] == owner) & (pair_ids[after] == pair_ids)
    wrong |= chosen & ~partnered
    before = np.roll(np.arange(len(ids)), 1)
    wrong |= rejected & ~(chosen[before] & (owner[before] == owner) & (pair_ids[before] == pair_ids))
    broken = np.zeros(bins.num_rows, bool)
    broken[owner[wrong]] = True
    return broken


def _sequence_problems(bins: pa.Table, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """cu_seqlens runs from 0 to num_tokens, strictly increasing; Σl² matches."""
    cu = bins["cu_seqlens"].combine_chunks()
    offsets = cu.offsets.to_numpy()
    values = cu.flatten().to_numpy().astype(np.int64)
    steps = np.diff(values)
    inside = np.ones(len(steps), bool)
    inside[offsets[1:-1] - 1] = False  # a step from one bin's list into the next
    bin_of_step = owner_of_elements(list_lengths(cu))[:-1]  # a step belongs to the bin of its start
    not_increasing = np.zeros(len(tokens), bool)
    not_increasing[bin_of_step[(steps <= 0) & inside]] = True
    squares = np.where(inside, steps, 0) ** 2
    sum_sq = np.bincount(bin_of_step, weights=squares, minlength=len(tokens)).astype(np.int64)
    return {
        "cu_seqlens: does not start at 0 and end at num_tokens": (values[offsets[:-1]] != 0)
        | (values[offsets[1:] - 1] != tokens),
        "cu_seqlens: not strictly increasing": not_increasing,
        "sum_sq_lengths != sum of squared sample lengths": sum_sq != bins["sum_sq_lengths"].to_numpy(),
    }


def _label_problems(bins: pa.Table) -> dict[str, np.ndarray]:
    """A label is the input id it sits on, or ignored; supervised_tokens counts the others."""
    ids = pc.list_flatten(bins["input_ids"]).to_numpy()
    labels = pc.list_flatten(bins["labels"]).to_numpy()
    bin_of_token = owner_of_elements(list_lengths(bins["labels"]))
    supervised = labels != IGNORE_INDEX
    wrong = np.zeros(bins.num_rows, bool)
    wrong[bin_of_token[supervised & (labels != ids)]] = True
    counted = np.bincount(bin_of_token[supervised], minlength=bins.num_rows)
    return {
        "labels: a supervised label differs from its input id": wrong,
        "supervised_tokens != labels that are not -100": counted != bins["supervised_tokens"].to_numpy(),
    }


def _media_problems(bins: pa.Table, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Every media span lies inside its bin; image/video token counts add up."""
    media = bins["media"].combine_chunks()
    items = media.flatten()
    bin_of_item = owner_of_elements(list_lengths(bins["media"]))
    start = items.field("token_offset").to_numpy().astype(np.int64)
    count = items.field("num_tokens").to_numpy().astype(np.int64)
    outside = np.zeros(bins.num_rows, bool)
    outside[bin_of_item[(start < 0) | (start + count > tokens[bin_of_item])]] = True
    kind = items.field("kind").to_numpy(zero_copy_only=False)
    found = {}
    for name in ("image", "video"):
        per_bin = np.bincount(bin_of_item, weights=np.where(kind == name, count, 0), minlength=bins.num_rows)
        found[name] = per_bin.astype(np.int64) != bins[f"{name}_tokens"].to_numpy()
    problems = {
        "media: a span lies outside its bin": outside,
        "image_tokens != the image spans' tokens": found["image"],
        "video_tokens != the video spans' tokens": found["video"],
    }
    if not outside.any():
        problems.update(_pad_problems(bins, *_pad_runs(items, bin_of_item, start, count)))
    return problems


def _pad_runs(
    items: pa.StructArray, bin_of_item: np.ndarray, start: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin, first token, length) of every run of pad tokens: one per item, or one per group
    where an item's pads are split by text (``group_starts``: Qwen3-VL's frame groups)."""
    groups = items.field("group_starts")
    per_item = pc.list_value_length(groups).fill_null(1).to_numpy(zero_copy_only=False).astype(np.int64)
    owner = owner_of_elements(per_item)
    relative = np.zeros(len(owner), np.int64)
    grouped = np.repeat(groups.is_valid().to_numpy(zero_copy_only=False), per_item)
    relative[grouped] = pc.list_flatten(groups).to_numpy(zero_copy_only=False)
    return bin_of_item[owner], start[owner] + relative, count[owner] // per_item[owner]


def _pad_problems(
    bins: pa.Table, bin_of_item: np.ndarray, start: np.ndarray, count: np.ndarray
) -> dict[str, np.ndarray]:
    """Vision embeddings = pad tokens, per span: a span holds only its pad id (the id at its
    first token), and no pad id stands outside every span (text that became a vision slot)."""
    ids_list = bins["input_ids"].combine_chunks()
    offsets = ids_list.offsets.to_numpy().astype(np.int64)
    ids = pc.list_flatten(ids_list).to_numpy()
    first = offsets[bin_of_item] + start  # each span's first token, in the flat ids
    span_of_position = owner_of_elements(count)
    positions = (
        np.repeat(first, count)
        + np.arange(len(span_of_position))
        - np.repeat(np.cumsum(count) - count, count)
    )
    pads = ids[first[count > 0]]
    mixed = np.zeros(bins.num_rows, bool)
    mixed[bin_of_item[span_of_position[ids[positions] != ids[first][span_of_position]]]] = True
    stray = np.isin(ids, np.unique(pads))
    stray[positions] = False
    loose = np.zeros(bins.num_rows, bool)
    loose[owner_of_elements(list_lengths(bins["input_ids"]))[stray]] = True
    return {
        "media: a span holds ids other than its pad id": mixed,
        "input_ids: a media pad id outside every media span": loose,
    }


def _describe(message: str, mask: np.ndarray) -> str:
    where = np.flatnonzero(mask)
    shown = ", ".join(str(i) for i in where[:EXAMPLES]) + (", ..." if len(where) > EXAMPLES else "")
    return f"{message} in {len(where)} bin(s) (rows {shown})"


def read_skipped(
    output: str, manifest: Mapping[str, Any], storage: fs.Storage
) -> tuple[list[str], list[str]]:
    """Ids the pack stage left out (report/pack_skipped.json), and the problem if their number
    is not the manifest's."""
    uri = schemas.report_uri(output, SKIPPED_NAME)
    expected = manifest["totals"]["skipped"]
    skipped = [s["sample_id"] for s in json.loads(storage.read_bytes(uri))] if storage.exists(uri) else []
    if len(skipped) != expected:
        return skipped, [f"{uri} lists {len(skipped)} skipped samples; the manifest says {expected}"]
    return skipped, []


def source_problems(
    spark, manifest: Mapping[str, Any], packed_ids, eval_ids, skipped: list[str], storage
) -> dict:
    """Every row of the source table version is where the mix puts it: in as many training bins
    as its copies, in one evaluation bin when held out, or skipped; nothing else is anywhere.

    The mix (``pack.mix.choose``) is computed again from the source rows and the manifest's
    config. Returns what was checked and a ``problems`` list. When the source version cannot
    be read any more (vacuumed, moved), the check is reported as not done, not as a failure.
    """
    source = dict(manifest["source"])
    try:
        snap = tables.snapshot(source["table"], storage, version=source["version"])
    except Exception as err:  # delta-rs raises several types for a missing table or version
        return {**source, "checked": False, "note": f"source not readable: {err}", "problems": []}
    rows = tables.read_arrow(source["table"], storage, columns=MIX_COLUMNS, snap=snap)
    ids = rows.column("sample_id")
    over = pc.is_in(ids, pa.array(skipped, pa.string())).to_numpy(zero_copy_only=False)
    chosen = mix.choose(rows, mix.MixSettings.from_manifest_config(manifest["config"]), np.flatnonzero(over))
    expected = pa.table(
        {
            "sample_id": ids,
            "train": chosen.copies,
            "eval": chosen.eval.astype(np.int64),
            "skipped": over.astype(np.int64),
        }
    )
    delivered = _tally(spark, {"train": packed_ids, "eval": eval_ids}, skipped)
    found = spark.createDataFrame(expected).join(delivered, "sample_id", "full_outer")
    problems = []
    for what, condition in (
        ("of the source table in fewer training bins than its copies", "coalesce(got_train, 0) < train"),
        ("in more training bins than its copies (or in more than one bin)", "coalesce(got_train, 0) > train"),
        ("in the evaluation shards other than the split says", "coalesce(got_eval, 0) != eval"),
        ("skipped other than as over budget", "coalesce(got_skipped, 0) != skipped"),
        ("in the shards but not in the source table version", "train IS NULL"),
    ):
        frame = found.where(condition)
        count = frame.count()
        if count:
            shown = sorted(r.sample_id for r in frame.select("sample_id").limit(EXAMPLES).collect())
            problems.append(f"{count} sample(s) {what}, e.g. {', '.join(shown)}")
    return {**source, "checked": True, "rows": rows.num_rows, "problems": problems}


def _tally(spark, packed: Mapping[str, Any], skipped: list[str]):
    """sample_id → how often it is in each pack (``got_<name>``) and in the skipped list."""
    from pyspark.sql import functions as F

    frames = [
        spark.createDataFrame([(s,) for s in skipped], "sample_id string").withColumn(
            "side", F.lit("skipped")
        )
    ]
    frames += [ids.withColumn("side", F.lit(name)) for name, ids in packed.items() if ids is not None]
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    sides = ["train", "eval", "skipped"]
    counted = union.groupBy("sample_id").pivot("side", sides).count()
    return counted.select("sample_id", *[F.col(side).alias(f"got_{side}") for side in sides])


def format_summary(s: Mapping[str, Any]) -> str:
    source = s["source"]
    checked = (
        f"checked against {source['table']} v{source['version']}"
        if source["checked"]
        else f"NOT checked against its source ({source['note']})"
    )
    lines = [
        f"validate  run {s['run_id']}  ({s['seconds']} s)",
        f"  {s['shards']} shard(s), {s['bins']} bins, {s['samples']} samples, {s['eval_samples']} evaluation "
        f"samples, {s['skipped']} skipped; "
        f"{s['bytes_hashed']:,} bytes hashed",
        f"  samples {checked}",
    ]
    if s["ok"]:
        lines.append(
            "  ok: every shard matches the manifest; every sample is where the mix puts it (its copies in "
            "training bins, one evaluation bin, or skipped)"
        )
    else:
        lines.append(f"  {s['problem_count']} problem(s):")
        lines += [f"    {p}" for p in s["problems"][:20]]
    return "\n".join(lines)
