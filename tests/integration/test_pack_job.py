"""The pack job end to end: demo tokenized table → shards + manifest.json + report."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mmpack_udfs import cli, schemas
from mmpack_udfs.io import tables
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.report import pack_report as report
from tests.conftest import demo_run, fresh_output
from tests.mmpack_udfs.pack.test_shards import decode

pytestmark = pytest.mark.spark

SMALL_SHARDS = ("pack.bins_per_shard=2", "pack.bins_per_row_group=1")


def run_pack(spark, demo, out: Path, *overrides: str) -> dict:
    return pack.run(spark, demo_run(demo, out, *overrides))


def manifest(out: Path) -> dict:
    return json.loads((out / "packed" / "manifest.json").read_text())


def shard_hashes(out: Path) -> list[str]:
    return [s["sha256"] for s in manifest(out)["shards"]]


@pytest.fixture(scope="module")
def packed(spark, demo, tokenized_demo, tmp_path_factory):
    out = fresh_output(tokenized_demo, tmp_path_factory.mktemp("pack"))
    return out, run_pack(spark, demo, out, *SMALL_SHARDS)


def test_shards_decode_back_to_exactly_the_tokenized_rows(packed):
    out, summary = packed
    m = manifest(out)
    decoded: dict[str, dict] = {}
    for shard in m["shards"]:
        table = pq.read_table(out / "packed" / shard["path"])
        assert table.schema.remove_metadata() == schemas.SHARD
        for batch in table.to_batches():
            got = decode(batch)
            assert not got.keys() & decoded.keys()  # no sample twice
            decoded.update(got)
    rows = {
        r["sample_id"]: r for r in tables.read_arrow(schemas.table_uri(str(out), "tokenized")).to_pylist()
    }
    assert decoded.keys() == rows.keys()
    media_items = 0
    for sid, row in rows.items():
        got = decoded[sid]
        assert got["input_ids"] == row["input_ids"] and got["labels"] == row["labels"]
        assert len(got["media"]) == len(row["media"])
        for g, w in zip(got["media"], row["media"], strict=True):
            assert {k: g[k] for k in w} == w
            assert g["data"] == Path(w["uri"]).read_bytes()
            media_items += 1
    assert media_items > 0
    assert m["totals"]["shards"] > 1
    assert summary["samples"] == len(rows) and summary["skipped"] == 0


def test_manifest_describes_every_shard(packed):
    out, summary = packed
    m = manifest(out)
    assert m["format"] == schemas.SHARD_FORMAT and m["format_version"] == schemas.SHARD_FORMAT_VERSION
    assert m["source"]["version"] == tables.snapshot(schemas.table_uri(str(out), "tokenized")).version
    assert m["config"]["pack"]["bins_per_shard"] == 2 and len(m["config_hash"]) == 64
    assert m["budget"] == 16384 and m["tool"]["name"] == "mmpack"
    for shard in m["shards"]:
        data = (out / "packed" / shard["path"]).read_bytes()
        assert shard["bytes"] == len(data) and shard["sha256"] == hashlib.sha256(data).hexdigest()
        assert pq.ParquetFile(out / "packed" / shard["path"]).metadata.num_rows == shard["rows"]
    totals = m["totals"]
    assert totals["bins"] == sum(s["rows"] for s in m["shards"]) == summary["bins"]
    assert totals["tokens"] == sum(s["tokens"] for s in m["shards"]) == summary["tokens"]
    assert totals["lower_bound_bins"] <= totals["bins"]
    named = {out / "packed" / s["path"] for s in [*m["shards"], m["cost_index"]]}
    assert set((out / "packed").rglob("*.parquet")) == named  # the placement's parts are gone


def test_report_json_and_plots(packed):
    out, summary = packed
    saved = json.loads((out / "report" / "pack.json").read_text())
    assert saved["fill"] == summary["fill"] and 0 < saved["fill"] <= 1
    assert saved["token_share"]["image"] > 0 and saved["attention_cost"]["max_over_mean"] >= 1
    assert saved["samples_per_bin"]["max"] >= saved["samples_per_bin"]["mean"]
    from mmpack_udfs.report import plots

    names = (plots.LENGTHS_PLOT, plots.TOKENS_PLOT, plots.SUPERVISED_PLOT, plots.ATTENTION_PLOT,
             plots.PATCHES_PLOT, plots.COST_PLOT)  # fmt: skip
    for name in names:
        png = (out / "report" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000  # a drawn plot, not an empty frame


def test_report_command(packed, capsys, tmp_path):
    out, _ = packed
    assert cli.main(["report", "--out", str(out)]) == cli.EXIT_OK
    assert "fill" in capsys.readouterr().out
    assert cli.main(["report", "--out", str(tmp_path)]) == cli.EXIT_FAILED
    assert "no manifest" in capsys.readouterr().err


def test_rerun_is_skipped_and_a_repack_is_byte_identical(spark, demo, packed):
    out, _ = packed
    before = (out / "packed" / "manifest.json").read_bytes()
    files = {p: p.read_bytes() for p in (out / "packed").rglob("*.parquet")}
    run_pack(spark, demo, out, *SMALL_SHARDS)  # already published: nothing is rewritten
    assert (out / "packed" / "manifest.json").read_bytes() == before
    for p in files:
        p.unlink()
    (out / "packed" / "manifest.json").unlink()
    run_pack(spark, demo, out, *SMALL_SHARDS)
    assert (out / "packed" / "manifest.json").read_bytes() == before
    assert {p: p.read_bytes() for p in (out / "packed").rglob("*.parquet")} == files


def test_a_run_killed_before_the_manifest_publishes_nothing(
    spark, demo, tokenized_demo, packed, tmp_path, monkeypatch
):
    out = fresh_output(tokenized_demo, tmp_path)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(pack, "publish_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        run_pack(spark, demo, out, *SMALL_SHARDS)
    assert list((out / "packed").rglob("*.parquet"))  # shards were written...
    assert not (out / "packed" / "manifest.json").exists()  # ...but nothing is published
    with pytest.raises(report.ReportError):
        report.read_manifest(str(out))
    monkeypatch.undo()
    run_pack(spark, demo, out, *SMALL_SHARDS)
    assert shard_hashes(out) == shard_hashes(packed[0])  # the same shards as an uninterrupted run


def test_a_killed_new_run_leaves_the_published_one_intact(spark, demo, tokenized_demo, tmp_path, monkeypatch):
    out = fresh_output(tokenized_demo, tmp_path)
    run_pack(spark, demo, out)
    published = (out / "packed" / "manifest.json").read_bytes()
    monkeypatch.setattr(
        pack, "publish_manifest", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed"))
    )
    with pytest.raises(RuntimeError):
        run_pack(spark, demo, out, "pack.seed=1")
    assert (out / "packed" / "manifest.json").read_bytes() == published
    for shard in manifest(out)["shards"]:
        assert hashlib.sha256((out / "packed" / shard["path"]).read_bytes()).hexdigest() == shard["sha256"]


def test_oversize_rows_fail_the_job_or_are_skipped_and_listed(spark, demo, tokenized_demo, tmp_path):
    out = fresh_output(tokenized_demo, tmp_path)
    with pytest.raises(pack.PackError, match="exceed the pack budget"):
        run_pack(spark, demo, out, "pack.budget=2000")
    summary = run_pack(spark, demo, out, "pack.budget=2000", "pack.oversize=skip")
    skipped = json.loads((out / "report" / "pack_skipped.json").read_text())
    lengths = tables.read_arrow(schemas.table_uri(str(out), "tokenized"), columns=["num_tokens"])
    over = sum(n > 2000 for n in lengths.column("num_tokens").to_pylist())
    assert over > 0 and len(skipped) == over == summary["skipped"]
    assert all(s["num_tokens"] > 2000 and s["reason"] == "over_budget" for s in skipped)
    assert summary["samples"] + summary["skipped"] == lengths.num_rows


def test_every_row_over_budget_is_a_failed_run_not_an_empty_manifest(spark, demo, tokenized_demo, tmp_path):
    out = fresh_output(tokenized_demo, tmp_path)
    shortest = min(
        tables.read_arrow(schemas.table_uri(str(out), "tokenized")).column("num_tokens").to_pylist()
    )
    with pytest.raises(pack.PackError, match=r"every one of the \d+ tokenized rows is over the pack budget"):
        run_pack(spark, demo, out, f"pack.budget={shortest - 1}", "pack.oversize=skip")
    assert not (out / "packed" / "manifest.json").exists()


def test_an_empty_tokenized_table_packs_no_bins(spark, demo, tmp_path):
    """Every record quarantined upstream: the table has no files, and pack says so (no tasks
    to read it with) instead of failing."""
    from pyspark.sql.pandas.types import from_arrow_schema

    empty = spark.createDataFrame([], from_arrow_schema(schemas.TOKENIZED))
    uri = schemas.table_uri(str(tmp_path), "tokenized")
    tables.write_table(
        empty, uri, schemas.TOKENIZED, run_id="e", mode="overwrite", sort_by=["sample_id"], rows_per_file=10
    )
    summary = run_pack(spark, demo, tmp_path)
    assert summary["bins"] == 0 and manifest(tmp_path)["shards"] == []


def test_second_budget_on_media_items(spark, demo, tokenized_demo, tmp_path):
    out = fresh_output(tokenized_demo, tmp_path)
    run_pack(
        spark, demo, out, "pack.second_budget_by=media_items", "pack.second_budget=3", "pack.oversize=skip"
    )
    for shard in manifest(out)["shards"]:
        media = pq.read_table(out / "packed" / shard["path"], columns=["media"]).column("media").to_pylist()
        assert max(len(m) for m in media) <= 3


def test_pack_to_s3_matches_the_local_run(spark, demo, tokenized_demo, packed, s3_bucket):
    import boto3

    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for path in (tokenized_demo / "tables" / "tokenized").rglob("*"):
        if path.is_file():
            key = (
                "out/tables/tokenized/" + path.relative_to(tokenized_demo / "tables" / "tokenized").as_posix()
            )
            client.upload_file(str(path), bucket, key)
    out = f"s3://{bucket}/out"
    overrides = (*SMALL_SHARDS, f"s3.endpoint_override={endpoint}", "s3.scheme=http", "s3.region=us-east-1")
    pack.run(spark, demo_run(demo, out, *overrides))
    m = json.loads(client.get_object(Bucket=bucket, Key="out/packed/manifest.json")["Body"].read())
    assert [s["sha256"] for s in m["shards"]] == shard_hashes(packed[0])
    objects = client.list_objects_v2(Bucket=bucket, Prefix="out/packed/")["Contents"]
    files = {o["Key"] for o in objects if not o["Key"].endswith("/")}  # not pyarrow's empty folder markers
    named = {f"out/packed/{s['path']}" for s in m["shards"]} | {f"out/packed/{m['cost_index']['path']}"}
    assert files == named | {"out/packed/manifest.json"}  # the placement's parts are gone
    assert all(o["Size"] == 0 for o in objects if o["Key"].endswith("/"))


def test_the_cost_index_has_one_row_per_bin_with_the_shards_figures(packed):
    out, _ = packed
    live = manifest(out)
    entry = live["cost_index"]
    data = (out / "packed" / entry["path"]).read_bytes()
    assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    index = pq.read_table(out / "packed" / entry["path"])
    assert (
        index.schema.equals(schemas.COST_INDEX) and index.num_rows == entry["rows"] == live["totals"]["bins"]
    )
    rows = index.to_pylist()
    position = 0
    for number, shard in enumerate(live["shards"]):
        bins = pq.read_table(out / "packed" / shard["path"]).to_pylist()
        for row, b in enumerate(bins):
            got = rows[position]
            position += 1
            lengths = [y - x for x, y in zip(b["cu_seqlens"], b["cu_seqlens"][1:], strict=False)]
            frames = [(m["grid_t"], m["grid_h"] * m["grid_w"]) for m in b["media"]]
            assert got == {
                "shard": number, "row": row, "tokens": len(b["input_ids"]),
                "sum_sq_lengths": sum(n * n for n in lengths), "media_items": len(b["media"]),
                "vision_patches": sum(t * p for t, p in frames),
                "vision_sq_patches": sum(t * p * p for t, p in frames),
                "supervised_tokens": sum(label != -100 for label in b["labels"]),
            }  # fmt: skip
    assert position == len(rows)


def test_gc_removes_superseded_and_killed_shards_never_published_ones(spark, demo, tokenized_demo, tmp_path):
    out = fresh_output(tokenized_demo, tmp_path)
    run_pack(spark, demo, out, "pack.seed=1")
    superseded = set((out / "packed" / "shards").rglob("*.parquet"))
    run_pack(spark, demo, out, "pack.seed=2")  # another run id: its own shard folder
    stray = out / "packed" / "shards" / "killed-run" / "g0-0.parquet"  # a pack killed before publishing
    stray.parent.mkdir()
    stray.write_bytes(b"PAR1 half written")
    live = manifest(out)
    named = {out / "packed" / s["path"] for s in [*live["shards"], live["cost_index"]]}
    assert named and not named & superseded
    before = set((out / "packed" / "shards").rglob("*.parquet"))
    assert cli.main(["gc", "--out", str(out), "--dry-run"]) == 0
    assert set((out / "packed" / "shards").rglob("*.parquet")) == before
    assert cli.main(["gc", "--out", str(out)]) == 0
    assert set((out / "packed" / "shards").rglob("*.parquet")) == named
    for shard in live["shards"]:
        assert hashlib.sha256((out / "packed" / shard["path"]).read_bytes()).hexdigest() == shard["sha256"]
