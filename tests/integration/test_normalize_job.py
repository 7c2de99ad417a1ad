"""The normalize job end to end on real demo data, real Spark and real Delta tables."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mmpack_udfs.io import fs, tables
from mmpack_udfs.normalize import stage as normalize
from mmpack_udfs.reasons import NORMALIZE_REASONS, PREFERENCE_REASONS, WEBDATASET_REASONS, Reason
from mmpack_udfs.schemas import table_uri
from tests.conftest import demo_run, only_dataset, with_datasets

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def first_run(spark, demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("normalize")
    summary = normalize.run(spark, demo_run(demo, out))
    return out, summary


def samples_of(out):
    return tables.read_arrow(table_uri(str(out), "samples")).sort_by("sample_id")


def quarantine_of(out):
    return tables.read_arrow(table_uri(str(out), "quarantine"))


def test_every_record_is_accounted_for(first_run, demo):
    out, summary = first_run
    t = summary["totals"]
    assert t["read"] == demo.records
    assert t["read"] == t["samples"] + t["quarantined"] + t["duplicates"]
    assert t["quarantined"] == demo.bad_records and t["duplicates"] == demo.duplicates
    assert samples_of(out).num_rows == t["samples"] and quarantine_of(out).num_rows == t["quarantined"]
    saved = json.loads((out / "report" / "normalize.json").read_text())
    assert saved["totals"] == t


def test_every_reason_code_has_a_real_bad_record(first_run):
    out, summary = first_run
    reasons = set(quarantine_of(out).column("reason").to_pylist())
    # the SFT demo: every normalize reason but the preference ones (tests/integration/test_preference_job.py)
    # and the WebDataset ones (tests/integration/test_bad_input_corpus.py)
    assert reasons == {r.value for r in NORMALIZE_REASONS - PREFERENCE_REASONS - WEBDATASET_REASONS}
    assert summary["reasons"] == dict(sorted(summary["reasons"].items()))


def test_all_three_datasets_and_dialects_arrive(first_run):
    out, summary = first_run
    per_dataset = Counter(samples_of(out).column("dataset").to_pylist())
    assert set(per_dataset) == {"sharegpt_jsonl", "openai_json", "custom_parquet"}
    assert all(n > 30 for n in per_dataset.values())
    assert {name: d["samples"] for name, d in summary["datasets"].items()} == per_dataset


def test_samples_carry_ordered_turns_and_probed_media(first_run):
    out, _ = first_run
    rows = samples_of(out).to_pylist()
    assert len({r["sample_id"] for r in rows}) == len(rows)
    multi_image = [r for r in rows if sum(m["kind"] == "image" for m in r["media"]) >= 2]
    with_video = [r for r in rows if any(m["kind"] == "video" for m in r["media"])]
    assert multi_image and with_video
    for row in multi_image + with_video:
        text = "".join(t["text"] for t in row["turns"])
        kinds = [m["kind"] for m in row["media"]]
        assert text.count("<image>") == kinds.count("image")
        assert text.count("<video>") == kinds.count("video")
        for m in row["media"]:
            assert m["width"] > 0 and m["height"] > 0 and fs.LOCAL.exists(m["uri"])
            if m["kind"] == "video":
                assert m["frames"] > 0 and m["fps"] > 0 and m["duration"] > 0
    assert any(r["system"] for r in rows) and any(r["system"] is None for r in rows)
    assert all(r["turns"][-1]["role"] == "assistant" for r in rows)


def test_quarantine_rows_point_at_their_source(first_run):
    out, _ = first_run
    for row in quarantine_of(out).to_pylist():
        if row["source_file"].endswith(".jsonl"):
            with open(row["source_file"], "rb") as f:
                f.seek(row["source_position"])
                assert f.readline().decode().rstrip("\n") == row["raw"]
        assert row["reason"] in {r.value for r in Reason} and row["detail"]


def test_rerun_of_the_same_input_commits_nothing(spark, demo, first_run):
    out, summary = first_run
    uri = table_uri(str(out), "samples")
    before = (tables.open_table(uri).version(), samples_of(out))
    again = normalize.run(spark, demo_run(demo, out))
    assert again["skipped"] is True and again["run_id"] == summary["run_id"]
    assert tables.open_table(uri).version() == before[0]
    assert samples_of(out).equals(before[1])


def files_by_partition(uri):
    """Data file bytes keyed by partition index (file names are part-<index>-<run tag>)."""
    return {Path(f).name.split("-")[1]: Path(f).read_bytes() for f in tables.data_files(uri)[1]}


def test_a_new_run_id_rewrites_byte_identical_files(spark, demo, first_run):
    out, _ = first_run
    uri = table_uri(str(out), "samples")
    version = tables.open_table(uri).version()
    before = files_by_partition(uri)
    rerun = normalize.run(spark, demo_run(demo, out, "run_id=forced-second-run"))
    assert rerun["tables"]["samples"]["version"] == version + 1
    after = files_by_partition(uri)
    assert after == before  # same partition → same bytes, only the names carry the run id


def test_splits_normalized_where_they_are_read_give_the_same_files(spark, demo, first_run):
    """Cut into many splits, the demo is normalized in the tasks that read it (no shuffle of
    raw records); its duplicates are dropped in the write: the tables are byte for byte those
    of the first run, which shuffled its few splits."""
    out, summary = first_run
    tasks = 2 * spark.sparkContext.defaultParallelism
    names = ("samples", "quarantine")
    before = {name: files_by_partition(table_uri(str(out), name)) for name in names}
    split = demo_run(demo, out, "run_id=read-and-normalized", "normalize.split_bytes=4096")
    rerun = normalize.run(spark, split)
    assert summary["splits"] < tasks <= rerun["splits"]
    assert rerun["totals"] == summary["totals"] and rerun["totals"]["duplicates"] > 0
    assert {name: files_by_partition(table_uri(str(out), name)) for name in names} == before


def test_append_a_second_dataset_counts_existing_samples_as_duplicates(spark, demo, tmp_path):
    out = tmp_path / "out"
    first = only_dataset(demo_run(demo, out), "sharegpt_jsonl")
    normalize.run(spark, first)
    existing = samples_of(out).to_pylist()
    extra = tmp_path / "extra.jsonl"
    new = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(4)
    ]
    old = [
        json.loads(
            json.dumps(
                {
                    "conversations": [
                        {
                            "from": {"user": "human", "assistant": "gpt"}[t["role"]],
                            "value": t["text"],
                        }
                        for t in r["turns"]
                    ]
                }
            )
        )
        for r in existing
        if not r["media"] and not r["system"]
    ][:2]
    extra.write_text("\n".join(json.dumps(r) for r in new + old) + "\n")
    second = with_datasets(
        demo_run(demo, out, "mode=append"),
        [{"name": "extra", "paths": [str(extra)], "media_root": str(tmp_path)}],
    )
    summary = normalize.run(spark, second)
    assert summary["datasets"]["extra"] == {
        "read": 6,
        "samples": 4,
        "quarantined": 0,
        "duplicates": len(old),
        "reasons": {},
    }
    assert len(old) == 2
    table = samples_of(out)
    assert table.num_rows == len(existing) + 4
    assert tables.open_table(table_uri(str(out), "samples")).version() == 1
    assert set(table.column("dataset").to_pylist()) == {"sharegpt_jsonl", "extra"}


def test_a_fresh_spark_session_reads_the_tables(first_run):
    out, _ = first_run
    code = (
        "import json, sys\n"
        "from mmpack_udfs.io.spark import get_spark\n"
        "from mmpack_udfs.config.model import SparkConfig\n"
        "from mmpack_udfs.io import tables\n"
        "spark = get_spark(SparkConfig(master='local[1]', log_level='ERROR',"
        " conf={'spark.ui.enabled': 'false'}))\n"
        f"df = tables.read_table(spark, {str(out / 'tables' / 'samples')!r})\n"
        "ids = sorted(r.sample_id for r in df.select('sample_id').collect())\n"
        "media = df.selectExpr('sum(size(media)) as n').first().n\n"
        "print(json.dumps({'ids': ids, 'media': media}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    expected = samples_of(out)
    assert got["ids"] == expected.column("sample_id").to_pylist()
    assert got["media"] == sum(len(m) for m in expected.column("media").to_pylist())
