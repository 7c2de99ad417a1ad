"""The tokenize job end to end: demo samples → Delta tokenized + tokenize_quarantine."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mmpack_udfs.io import tables
from mmpack_udfs.normalize import stage as normalize
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.tokenize import stage as tokenize
from mmpack_udfs.tokenize.encoder import IGNORE, SampleTokenizer, TokenizeSettings
from tests.conftest import demo_run

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def normalized(spark, demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenize")
    normalize.run(spark, demo_run(demo, out))
    return out


@pytest.fixture(scope="module")
def first_run(spark, demo, normalized):
    config = demo_run(demo, normalized, "tokenize.rows_per_file=40")
    return config, tokenize.run(spark, config)


def tokenized_rows(out) -> list[dict]:
    return sorted(
        tables.read_arrow(table_uri(str(out), "tokenized")).to_pylist(), key=lambda r: r["sample_id"]
    )


def test_every_sample_is_tokenized_or_quarantined(first_run, demo, normalized):
    _, summary = first_run
    counts = summary["counts"]
    samples = tables.read_arrow(table_uri(str(normalized), "samples")).num_rows
    assert counts["samples_in"] == samples == counts["tokenized_samples"] + counts["quarantined"]
    assert counts["quarantined"] == demo.tokenize_rejects
    # media_unsupported: the panorama, the one-frame video and the three audio samples (Qwen2-VL
    # encodes no audio)
    assert summary["reasons"] == {"media_unsupported": 5, "too_long": 1}
    quarantined = tables.read_arrow(table_uri(str(normalized), "tokenize_quarantine")).to_pylist()
    audio = [r for r in quarantined if r["detail"].startswith("audio: ")]
    assert len(audio) == 3 and all(
        r["detail"] == "audio: a qwen2_vl model encodes image and video only" for r in audio
    )
    assert summary["units"] > 1  # several Spark tasks, each writing its own files
    rows = tokenized_rows(normalized)
    assert len(rows) == counts["tokenized_rows"] == counts["tokenized_samples"]
    t = summary["tokens"]
    assert t["total"] == sum(r["num_tokens"] for r in rows) == t["text"] + t["image"] + t["video"]
    assert t["image"] > 0 and t["video"] > 0 and t["max"] <= 16384


def test_rows_are_consistent(first_run, normalized):
    for row in tokenized_rows(normalized):
        ids, labels = np.array(row["input_ids"]), np.array(row["labels"])
        assert len(ids) == len(labels) == row["num_tokens"]
        assert ((labels == IGNORE) | (labels == ids)).all()
        assert row["supervised_tokens"] == (labels != IGNORE).sum() > 0
        assert row["image_tokens"] == sum(m["num_tokens"] for m in row["media"] if m["kind"] == "image")
        for m in row["media"]:
            span = ids[m["token_offset"] : m["token_offset"] + m["num_tokens"]]
            assert len(set(span.tolist())) == 1 and len(span) == m["num_tokens"]
            if m["kind"] == "video":
                assert len(m["frame_indices"]) == 2 * m["grid_t"]


def test_spark_output_equals_the_pure_tokenizer(first_run, normalized):
    config, _ = first_run
    tokenizer = SampleTokenizer(TokenizeSettings.from_config(config.config))
    samples = {
        s["sample_id"]: s for s in tables.read_arrow(table_uri(str(normalized), "samples")).to_pylist()
    }
    for row in tokenized_rows(normalized)[:25]:
        (expected,), _ = tokenizer.tokenize([samples[row["sample_id"]]])
        assert row["input_ids"] == expected.input_ids.tolist()
        assert row["labels"] == expected.labels.tolist()


def test_rerun_is_skipped_and_a_new_run_id_rewrites_identical_files(spark, demo, first_run, normalized):
    config, summary = first_run
    uri = table_uri(str(normalized), "tokenized")
    assert tokenize.run(spark, config)["skipped"] is True
    before = {Path(f).name.split("-")[1]: Path(f).read_bytes() for f in tables.data_files(uri)[1]}
    again = tokenize.run(
        spark, demo_run(demo, normalized, "tokenize.rows_per_file=40", "run_id=tokenize-again")
    )
    assert again["tables"]["tokenized"]["version"] == summary["tables"]["tokenized"]["version"] + 1
    after = {Path(f).name.split("-")[1]: Path(f).read_bytes() for f in tables.data_files(uri)[1]}
    assert after == before


KILLED_BETWEEN_COMMITS = """
import json, os, signal, sys
from mmpack_udfs.io import tables
from mmpack_udfs.config.loading import checked
from mmpack_udfs.context import RunContext
from mmpack_udfs.io.spark import get_spark
from mmpack_udfs.tokenize import stage as tokenize
config = checked(json.loads(open(sys.argv[1]).read()))
real_commit, calls = tables.commit, []
def commit_then_die(*args, **kwargs):
    calls.append(args[0])
    if len(calls) == 2:  # the tokenized table is committed, the quarantine table not yet
        os.kill(os.getpid(), signal.SIGKILL)
    return real_commit(*args, **kwargs)
tables.commit = commit_then_die
tokenize.run(get_spark(config.spark), RunContext.of(config))
"""


def test_a_rerun_after_kill_9_between_the_two_commits_commits_each_table_once(
    spark, demo, normalized, tmp_path
):
    import json
    import subprocess
    import sys

    config = demo_run(demo, normalized, "run_id=killed-between-commits")
    (tmp_path / "config.json").write_text(json.dumps(config.config.as_dict()))
    root = Path(__file__).resolve().parents[2]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_BETWEEN_COMMITS, str(tmp_path / "config.json")],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    uri = table_uri(str(normalized), "tokenized")
    assert tables.committed_run(uri, "killed-between-commits") is not None  # the first commit landed
    version = tables.open_table(uri).version()
    summary = tokenize.run(spark, config)
    assert tables.open_table(uri).version() == version  # no second commit of the same run
    runs = [e for e in tables.open_table(uri).history() if e.get("mmpack_run_id") == "killed-between-commits"]
    assert len(runs) == 1
    counts = summary["counts"]
    assert counts["samples_in"] == counts["tokenized_samples"] + counts["quarantined"]
    assert tables.read_arrow(uri).num_rows == counts["tokenized_rows"]


def test_split_policy_accounts_for_every_sample(spark, demo, normalized):
    config = demo_run(
        demo, normalized, "tokenize.over_length=split", "tokenize.max_tokens=1500", "run_id=split-run"
    )
    summary = tokenize.run(spark, config)
    counts = summary["counts"]
    assert counts["samples_in"] == counts["tokenized_samples"] + counts["quarantined"]
    assert counts["tokenized_rows"] > counts["tokenized_samples"]  # some samples became pieces
    rows = tokenized_rows(normalized)
    pieces = Counter(r["parent_id"] for r in rows)
    split = [p for p, n in pieces.items() if n > 1]
    assert split and all(r["num_tokens"] <= 1500 for r in rows)
    assert counts["over_length"] >= len(split)  # every split sample was over; some fit in one piece
    assert all(r["sample_id"].startswith(r["parent_id"] + "-") for r in rows if r["parent_id"] in split)
