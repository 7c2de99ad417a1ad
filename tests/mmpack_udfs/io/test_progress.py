"""Stage progress lines (pure formatting) and the watcher on a real local Spark job."""

import io

import pytest

from mmpack_udfs.io.progress import Tasks, format_progress, stage_progress


def test_a_progress_line_says_done_of_total_rate_and_eta():
    assert format_progress("tokenize", Tasks(12, 40), 8.0) == (
        "tokenize: 12/40 tasks (30 %), 8 s elapsed, 1.5 tasks/s, ETA 19 s"
    )
    assert format_progress("pack", Tasks(0, 5), 1.0) == "pack: 0/5 tasks (0 %), 1 s elapsed"
    done = format_progress("pack", Tasks(5, 5, failed=1), 2.0)
    assert done == "pack: 5/5 tasks (100 %), 2 s elapsed, 2.5 tasks/s, 1 failed attempts (retried)"


@pytest.mark.spark
def test_a_stage_without_a_terminal_gets_plain_lines_ending_with_all_tasks_done(spark):
    stream = io.StringIO()  # not a TTY
    with stage_progress(spark, "demo-stage", 0.05, stream):
        spark.range(0, 200_000, numPartitions=6).selectExpr("sum(id % 7)").collect()
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("demo-stage: ") and "\r" not in line for line in lines)
    final = lines[-1].split(": ")[1].split(" tasks")[0]
    done, total = map(int, final.split("/"))
    assert done == total >= 6  # the range's six tasks, and the aggregate's; skipped stages not counted
    spark.range(3).count()  # after the block, jobs belong to no group
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None


def test_no_progress_when_turned_off(spark):
    stream = io.StringIO()
    with stage_progress(spark, "off", 0, stream):
        spark.range(10).count()
    assert stream.getvalue() == ""
