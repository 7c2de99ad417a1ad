"""``mmpack balance-report`` on a real packed output and on hand-made index files."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmpack_udfs import cli

pytestmark = pytest.mark.spark

KEYS = {"overhead_step", "overhead_vision", "overhead_llm", "read_amplification", "steps"}


def report(capsys, *args: str) -> dict:
    assert cli.main(["balance-report", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_report_of_a_pack_compares_todays_order_with_the_balanced_plan(packed_demo, capsys):
    result = report(capsys, "--out", str(packed_demo), "--world-size", "4", "--micro-batches", "2")
    manifest = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    bins = manifest["totals"]["bins"]
    assert result["bins"] == bins and result["world_size"] == 4 and result["micro_batches"] == 2
    for order in ("random", "balanced"):
        assert set(result[order]) == KEYS
        assert result[order]["steps"] == math.ceil(math.ceil(bins / 4) / 2)
        assert result[order]["read_amplification"] >= 1
    balanced, random = result["balanced"], result["random"]
    assert balanced["overhead_llm"] < random["overhead_llm"]
    assert balanced["overhead_step"] < random["overhead_step"]


def test_the_text_report_names_both_orders(packed_demo, capsys):
    assert cli.main(["balance-report", "--out", str(packed_demo)]) == 0
    text = capsys.readouterr().out
    assert "8 ranks" in text and "random" in text and "balanced" in text and "vision" in text


def test_any_index_file_with_the_columns_works_and_a_calibrated_model_counts(packed_demo, tmp_path, capsys):
    manifest = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    index = pq.read_table(packed_demo / "packed" / manifest["cost_index"]["path"])
    pq.write_table(index, tmp_path / "mine.parquet")
    args = ("--index", str(tmp_path / "mine.parquet"), "--world-size", "2", "--bins-per-row-group", "2")
    default = report(capsys, *args)
    text_only = report(capsys, *args, "--set", "balance.cost_model.qwen2_vl.vision_patch=0",
                       "--set", "balance.cost_model.qwen2_vl.vision_pair=0")  # fmt: skip
    assert default["bins"] == index.num_rows
    assert default["random"]["overhead_vision"] > 0 and text_only["random"]["overhead_vision"] == 0


def test_a_file_that_is_not_a_cost_index_is_named(tmp_path, capsys):
    pq.write_table(pa.table({"shard": [0], "row": [0], "tokens": [5]}), tmp_path / "x.parquet")
    assert cli.main(["balance-report", "--index", str(tmp_path / "x.parquet")]) == 1
    assert "lacks the column(s)" in capsys.readouterr().err
    assert cli.main(["balance-report"]) == 1
    assert "exactly one of --out" in capsys.readouterr().err
