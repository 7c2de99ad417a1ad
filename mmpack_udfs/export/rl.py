"""``mmpack export rl``: the tokenized samples → an RL prompt set (verl's ``RLHFDataset``).

    driver: refusals, exit 2: no tokenized table, a family whose generation prompt mmpack has
            not checked (``Family.rl_prompts``), a DEST that is not empty
    Spark:  per sample of ``samples`` (those tokenize kept, by ``tokenized``'s parent ids):
            the prompt (the conversation up to its last user turn) counted with tokenize's own
            renderer plus the generation prompt, vision tokens included; kept when it fits
            ``max_prompt_length``; its images embedded
    Spark:  the prompts sorted by sample id into ``DEST/prompts-NNNNN.parquet``
    driver: ``DEST/excluded.parquet`` (every sample not exported, with its reason) and, last,
            ``DEST/mmpack_rl_export.json``; samples = exported + dropped + quarantined, checked

A row (``--format verl``) is what verl's ``RLHFDataset`` reads (checked against verl 0.9.1):
``data_source`` (the dataset), ``prompt`` (chat messages, ``<image>`` placeholders in the
text), ``images`` (``{bytes, path, min_pixels, max_pixels}``: verl hands these keys to its
image resize, so it resizes as the model's processor does), ``ability``, ``reward_model``
(``{style: "rule", ground_truth: the final answer}``) and ``extra_info`` (``split``,
``index``, ``sample_id``, ``prompt_tokens``, ``answer``). ``--format easyr1``: EasyR1's
columns instead (``problem``: the one user turn, ``answer``, ``images``), single-turn prompts
only (else ``not_single_turn``). Not exported, with a reason:
``too_long`` (over ``max_prompt_length``), ``video_in_prompt`` (verl samples a video's frames
with its own settings: mmpack cannot give that count), ``thin_image`` (a side under half a
merged patch, which verl's own resize widens where the processor scales the whole image),
``media_in_answer``,
``unsupported_role`` (a prompt turn other than user or assistant), ``preference_pair``, and
what tokenize quarantined (its reason).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.context import RunContext
from mmpack_udfs.errors import ReconciliationError
from mmpack_udfs.export.energon import ExportRefused, refuse_non_empty
from mmpack_udfs.families import make_family
from mmpack_udfs.io import fs, tables
from mmpack_udfs.io.memory import releasing
from mmpack_udfs.reasons import Rejected
from mmpack_udfs.tokenize.encoder import TokenizeSettings, worker_tokenizer

FORMATS = ("verl", "easyr1")
MANIFEST = "mmpack_rl_export.json"
EXCLUDED = "excluded.parquet"
ROWS_PER_FILE = 5000
ROW_GROUP_ROWS = 500  # prompts a task holds while writing, and the files' row groups
EXPORTED, DROPPED, QUARANTINED = "exported", "dropped", "quarantined"
PROMPT_ROLES = ("user", "assistant")

IMAGE = pa.struct(
    [("bytes", pa.binary()), ("path", pa.string()), ("min_pixels", pa.int64()), ("max_pixels", pa.int64())]
)
VERL = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(IMAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("sample_id", pa.string()),
                    ("prompt_tokens", pa.int32()),
                    ("answer", pa.string()),
                ]
            ),
        ),
    ]
)
OUTCOME = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("status", pa.string()),  # exported | dropped | quarantined
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("prompt_tokens", pa.int32()),
    ]
)
# EasyR1's RLHFDataset (hiyouga/EasyR1 verl/utils/dataset.py; not on PyPI): one user turn as a
# string (``data.prompt_key: problem``), the answer, the images as dicts with their bytes
EASYR1 = pa.schema(
    [
        ("problem", pa.string()),
        ("answer", pa.string()),
        VERL.field("images"),
        VERL.field("data_source"),
        VERL.field("extra_info"),
    ]
)
COLUMNS = {"verl": VERL, "easyr1": EASYR1}
PROMPT_ROWS = pa.schema([*OUTCOME, *VERL, EASYR1.field("problem"), EASYR1.field("answer")])
WRITTEN = pa.schema(
    [("path", pa.string()), ("rows", pa.int64()), ("bytes", pa.int64()), ("sha256", pa.string())]
)


def checked_settings(ctx: RunContext, dest: str, max_prompt_length: int, fmt: str) -> TokenizeSettings:
    """The tokenize settings the prompts are counted with, once every refusal passed."""
    if fmt not in FORMATS:
        raise ExportRefused(f"--format {fmt!r}: mmpack writes {', '.join(FORMATS)}")
    if max_prompt_length < 1:
        raise ExportRefused(
            f"--max-prompt-length must be a positive number of tokens, got {max_prompt_length}"
        )
    if tables.open_table(ctx.table("tokenized"), ctx.storage) is None:
        raise ExportRefused(f"no tokenized table under {ctx.output}: run tokenize first (mmpack tokenize)")
    settings = TokenizeSettings.from_config(ctx.config, ctx.model)
    family = make_family(settings.profile_name, settings.profile)
    if not family.rl_prompts:
        raise ExportRefused(
            f"profile {settings.profile_name!r} ({family.kind}): mmpack has not checked its chat template's "
            "generation prompt against its processor, so it cannot count RL prompts exactly"
        )
    refuse_non_empty(fs.normalize_uri(dest).rstrip("/"), ctx.storage)
    return settings


def run(
    spark,
    ctx: RunContext,
    dest: str,
    max_prompt_length: int,
    fmt: str = "verl",
    settings: TokenizeSettings | None = None,
) -> dict[str, Any]:
    """Export the prompts of OUT's tokenized samples to ``dest``; returns the export manifest.
    ``settings``: what ``checked_settings`` returned for the same arguments."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    started = time.time()
    storage, dest = ctx.storage, fs.normalize_uri(dest).rstrip("/")
    settings = settings or checked_settings(ctx, dest, max_prompt_length, fmt)
    samples = tables.read_table(spark, ctx.table("samples"), storage)
    kept = tables.read_table(spark, ctx.table("tokenized"), storage).select(
        F.col("parent_id").alias("sample_id")
    )
    kept = kept.distinct().withColumn("tokenized", F.lit(True))
    refused = tables.read_table(spark, ctx.table("tokenize_quarantine"), storage)
    refused = refused.select("sample_id", F.col("reason").alias("tokenize_reason")).dropDuplicates(
        ["sample_id"]
    )
    rows = samples.join(kept, "sample_id", "left").join(refused, "sample_id", "left")
    body = partial(prompt_batches, settings=settings, limit=max_prompt_length, fmt=fmt, storage=storage)
    outcomes = rows.mapInArrow(releasing(body), from_arrow_schema(PROMPT_ROWS)).persist(
        StorageLevel.DISK_ONLY
    )
    try:
        excluded = pa.Table.from_pandas(
            outcomes.filter(f"status != '{EXPORTED}'").select(*OUTCOME.names).toPandas(),
            OUTCOME,
            preserve_index=False,
        ).sort_by("sample_id")
        exported = outcomes.filter(f"status = '{EXPORTED}'").select(*COLUMNS[fmt].names)
        count = exported.count()
        files = max(1, math.ceil(count / ROWS_PER_FILE))
        ordered = exported.repartition(files, "extra_info.sample_id").sortWithinPartitions(
            "extra_info.sample_id"
        )
        write = partial(write_prompts, dest=dest, storage=storage, schema=COLUMNS[fmt])
        written = [
            r.asDict() for r in ordered.mapInArrow(releasing(write), from_arrow_schema(WRITTEN)).collect()
        ]
    finally:
        outcomes.unpersist()
    written.sort(key=lambda w: w["path"])
    storage.write_bytes(fs.join(dest, EXCLUDED), _parquet_bytes(excluded))
    manifest = export_manifest(
        ctx, settings, max_prompt_length, fmt, count, excluded, written, samples.count()
    )
    reconcile(manifest)
    storage.write_bytes(
        fs.join(dest, MANIFEST), (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    )
    print(format_summary(dest, manifest, time.time() - started))
    return manifest


# -- executors ---------------------------------------------------------------------------------
# verl resizes a prompt's images with qwen_vl_utils before the processor: a side under half a
# merged patch (14 px for Qwen2-VL) is widened to one whole patch there, where the model's
# processor scales the whole image up, so the two count different vision tokens (12 x 900 px:
# 32 against the processor's 18).
THIN_IMAGE = "an image side under half a merged patch: verl's resize and the processor's count differ"


def prompt_batches(
    batches: Iterator[pa.RecordBatch], settings: TokenizeSettings, limit: int, fmt: str, storage: fs.Storage
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: samples rows (with ``tokenized`` and ``tokenize_reason``) → PROMPT_ROWS."""
    tokenizer = worker_tokenizer(settings.on_this_machine(storage))
    family = tokenizer.profile
    for batch in batches:
        rows = [prompt_row(sample, tokenizer, family, limit, fmt, storage) for sample in batch.to_pylist()]
        yield pa.RecordBatch.from_pylist(rows, schema=PROMPT_ROWS)


def prompt_row(
    sample: Mapping[str, Any], tokenizer, family, limit: int, fmt: str, storage: fs.Storage
) -> dict[str, Any]:
    """One sample's outcome, and its row (both formats' columns) when exported."""

    def outcome(status: str, reason: str | None = None, detail: str | None = None, tokens: int | None = None):
        return {"sample_id": sample["sample_id"], "dataset": sample["dataset"], "status": status,
                "reason": reason, "detail": detail, "prompt_tokens": tokens}  # fmt: skip

    if not sample.get("tokenized"):
        return outcome(
            QUARANTINED, sample.get("tokenize_reason") or "not_tokenized", "tokenize quarantined it"
        )
    if sample.get("rejected") is not None:
        return outcome(DROPPED, "preference_pair", "a preference pair: its prompt is in the DPO pack")
    turns, answer = sample["turns"][:-1], sample["turns"][-1]
    shown = sum(len(schemas.MEDIA_PLACEHOLDER.findall(t["text"])) for t in turns)
    media = sample["media"][:shown]
    if len(media) < len(sample["media"]):
        return outcome(DROPPED, "media_in_answer", "the final answer holds media: a prompt cannot show them")
    if any(m["kind"] == "video" for m in media):
        return outcome(DROPPED, "video_in_prompt", "verl samples video frames with its own settings")
    if any(min(m["width"], m["height"]) * 2 <= family.factor for m in media):
        return outcome(DROPPED, "thin_image", THIN_IMAGE)
    roles = sorted({t["role"] for t in turns} - set(PROMPT_ROLES))
    if roles:
        return outcome(DROPPED, "unsupported_role", f"a prompt turn of role {', '.join(roles)}")
    if fmt == "easyr1" and (len(turns) != 1 or sample["system"] is not None):
        return outcome(
            DROPPED, "not_single_turn", "EasyR1 prompts are one user turn, without a system prompt"
        )
    try:
        tokens = tokenizer.prompt_tokens(sample["system"], turns, family.plans(media))
    except Rejected as rejected:
        return outcome(QUARANTINED, str(rejected.reason), rejected.detail)
    if tokens > limit:
        return outcome(DROPPED, "too_long", f"{tokens} prompt tokens > max_prompt_length {limit}", tokens)
    limits = family.settings["image"]  # verl resizes with these, as the processor does
    images = [
        {"bytes": storage.read_bytes(m["uri"]), "path": m["uri"].rsplit("/", 1)[-1],
         "min_pixels": limits["min_pixels"], "max_pixels": limits["max_pixels"]}
        for m in media
    ]  # fmt: skip
    system = [{"role": "system", "content": sample["system"]}] if sample["system"] is not None else []
    return {
        **outcome(EXPORTED, tokens=tokens),
        "data_source": sample["dataset"],
        "prompt": system + [{"role": t["role"], "content": t["text"]} for t in turns],
        "images": images,
        "ability": "vision" if images else "text",
        "reward_model": {"style": "rule", "ground_truth": answer["text"]},
        "problem": turns[0]["text"],
        "answer": answer["text"],
        "extra_info": {
            "split": "train",
            "index": int(sample["sample_id"][:15], 16),
            "sample_id": sample["sample_id"],
            "prompt_tokens": tokens,
            "answer": answer["text"],
        },
    }


def write_prompts(
    batches: Iterator[pa.RecordBatch], dest: str, storage: fs.Storage, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: one partition's prompts (sorted) → ``DEST/prompts-<partition>.parquet``,
    streamed a row group at a time (a file of prompts with their images is never whole in
    memory), hashed on the way out."""
    from pyspark import TaskContext

    groups = _row_groups(batches, ROW_GROUP_ROWS, schema)
    first = next(groups, None)
    if first is None:
        return
    path = f"prompts-{TaskContext.get().partitionId():05d}.parquet"
    rows = 0
    with storage.atomic_output(fs.join(dest, path)) as stream:
        sink = fs.HashingSink(stream)
        with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
            for group in itertools.chain([first], groups):
                writer.write_table(group)
                rows += group.num_rows
    yield pa.RecordBatch.from_pylist(
        [{"path": path, "rows": rows, "bytes": sink.size, "sha256": sink.hexdigest()}], schema=WRITTEN
    )


def _row_groups(batches: Iterator[pa.RecordBatch], rows: int, schema: pa.Schema) -> Iterator[pa.Table]:
    """``batches`` re-cut into tables of ``rows`` rows (the last one shorter): row groups that do
    not depend on where Spark cut its Arrow batches, so the file's bytes do not either."""
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        held.append(batch)
        count += batch.num_rows
        while count >= rows:
            table = pa.Table.from_batches(held, schema=schema)
            yield table.slice(0, rows)
            held, count = table.slice(rows).to_batches(), count - rows
    rest = pa.Table.from_batches(held, schema=schema)
    if rest.num_rows:
        yield rest


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=ROW_GROUP_ROWS)
    return sink.getvalue().to_pybytes()


# -- driver: the record ----------------------------------------------------------------------
def export_manifest(
    ctx: RunContext,
    settings: TokenizeSettings,
    limit: int,
    fmt: str,
    exported: int,
    excluded: pa.Table,
    written: list[dict[str, Any]],
    samples: int,
) -> dict[str, Any]:
    def by_reason(status: str) -> dict[str, int]:
        reasons = [
            r
            for s, r in zip(excluded["status"].to_pylist(), excluded["reason"].to_pylist(), strict=True)
            if s == status
        ]
        return {reason: reasons.count(reason) for reason in sorted(set(reasons))}

    return {
        "format": "mmpack-rl",
        "format_version": 1,
        "trainer": fmt,
        "max_prompt_length": limit,
        "trainer_settings": trainer_settings(fmt, limit, settings.profile["image"]),
        "profile": settings.profile_name,
        "model": ctx.model_record(),
        "source": {
            "output": ctx.output,
            "samples_version": tables.data_files(ctx.table("samples"), ctx.storage)[0],
            "tokenized_version": tables.data_files(ctx.table("tokenized"), ctx.storage)[0],
        },
        "totals": {
            "samples": samples,
            "exported": exported,
            "dropped": sum(by_reason(DROPPED).values()),
            "quarantined": sum(by_reason(QUARANTINED).values()),
        },
        "dropped": by_reason(DROPPED),
        "quarantined": by_reason(QUARANTINED),
        "files": written,
        "excluded": EXCLUDED,
    }


def trainer_settings(fmt: str, limit: int, image: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's data settings under which its counts are mmpack's."""
    if fmt == "verl":  # images carry the processor's min/max pixels: verl resizes with them
        return {"data.max_prompt_length": limit, "data.filter_overlong_prompts": True}
    return {  # EasyR1 resizes every image to its data.min/max_pixels before the processor
        "data.prompt_key": "problem", "data.answer_key": "answer", "data.image_key": "images",
        "data.max_prompt_length": limit, "data.min_pixels": image["min_pixels"],
        "data.max_pixels": image["max_pixels"], "data.format_prompt": None,
    }  # fmt: skip


def reconcile(manifest: Mapping[str, Any]) -> None:
    """Every sample exported, dropped or quarantined, once; the files hold the exported."""
    t = manifest["totals"]
    problems = []
    if t["samples"] != t["exported"] + t["dropped"] + t["quarantined"]:
        problems.append(f"samples {t['samples']} != exported {t['exported']} + dropped {t['dropped']} + "
                        f"quarantined {t['quarantined']}")  # fmt: skip
    if sum(f["rows"] for f in manifest["files"]) != t["exported"]:
        problems.append(
            f"the files hold {sum(f['rows'] for f in manifest['files'])} rows, {t['exported']} exported"
        )
    if problems:
        raise ReconciliationError("the RL export does not account for its samples: " + "; ".join(problems))


def format_summary(dest: str, manifest: Mapping[str, Any], seconds: float) -> str:
    t = manifest["totals"]

    def listed(status: str) -> str:
        return ", ".join(f"{r} {n}" for r, n in manifest[status].items()) or "none"

    return (
        f"export rl ({manifest['trainer']}): {t['exported']} of {t['samples']} samples as prompts of "
        f"at most {manifest['max_prompt_length']} tokens in {len(manifest['files'])} files → {dest} "
        f"({seconds:.1f} s); dropped {t['dropped']} ({listed('dropped')}), quarantined by tokenize or "
        f"the prompt's media {t['quarantined']} ({listed('quarantined')})"
    )
