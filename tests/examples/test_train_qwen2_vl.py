"""examples/train_qwen2_vl.py under torchrun: real DDP (gloo, CPU processes), a tiny random
Qwen2-VL, demo shards with images and videos whose bin count no world size here divides.

What must hold: the run ends (a hang at an epoch end is a timeout, and fails), every rank
runs the same number of micro-batches, every real sample's supervised tokens are trained
exactly once per epoch, and a resume from a mid-epoch checkpoint trains exactly the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mmpack_udfs.demo import data as demo_data
from tests.conftest import PACKED_DEMO_SETTINGS, demo_run

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_qwen2_vl.py"
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def packed(spark, tmp_path_factory) -> Path:
    """A small demo (images and videos) packed into 11 bins: neither 2 nor 3 divides it. One
    packing group, so the bin count depends on sample lengths only (sample ids hash the
    media paths, and the hash of an id picks its group)."""
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize

    data = demo_data.generate(tmp_path_factory.mktemp("ddp-demo"), samples=60, seed=12)
    out = tmp_path_factory.mktemp("ddp-out")
    config = demo_run(data, out, *PACKED_DEMO_SETTINGS)
    normalize.run(spark, config)
    tokenize.run(spark, config)
    pack.run(spark, config)
    return out / "packed"


def expected_supervised(packed: Path) -> dict[str, int]:
    """Per sample, its supervised tokens, read from the shards with pyarrow alone: labels
    ≠ -100, not counting a sample's first token (it is never a target)."""
    manifest = json.loads((packed / "manifest.json").read_text())
    out = {}
    for shard in manifest["shards"]:
        table = pq.read_table(packed / shard["path"], columns=["labels", "cu_seqlens", "sample_ids"])
        for labels, cu, ids in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
            supervised = np.asarray(labels) != -100
            for sample, a, b in zip(ids, cu[:-1], cu[1:], strict=True):
                out[sample] = int(supervised[a + 1 : b].sum())
    return out


def torchrun(world: int, *args: str, log: Path) -> str:
    """Run the example under torchrun, output in ``log``. A run still going after TIMEOUT_S (a
    hang) fails the test; torchrun is stopped with SIGTERM, which its agent passes on to
    every rank (ranks run in sessions of their own), then killed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*command, str(EXAMPLE), *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
            pytest.fail(f"torchrun with {world} ranks did not finish in {TIMEOUT_S} s (a rank hung)")
    output = log.read_text()
    assert process.returncode == 0, output[-6000:]
    return output


def read_trace(trace: Path, world: int) -> list[list[dict]]:
    """Per rank, its micro-batch records in order."""
    return [
        [json.loads(line) for line in Path(f"{trace}.rank{r}").read_text().splitlines()] for r in range(world)
    ]


def check_epoch(records: list[list[dict]], epoch: int, expected: dict[str, int]) -> None:
    per_rank = [[r for r in rank if r["epoch"] == epoch] for rank in records]
    assert len({len(rank) for rank in per_rank}) == 1, (
        f"epoch {epoch}: ranks ran {[len(r) for r in per_rank]}"
    )
    trained: dict[str, list[int]] = defaultdict(list)
    for rank in per_rank:
        for record in rank:
            for sample, tokens in record["samples"].items():
                trained[sample].append(tokens)
    assert {s: t for s, t in trained.items() if len(t) > 1} == {}, "samples trained twice"
    assert {s: t[0] for s, t in trained.items()} == expected
    bins = len({tuple(r["samples"]) for rank in per_rank for r in rank if r["samples"]})
    fillers = sum(r["fillers"] for rank in per_rank for r in rank)
    assert fillers == -(-bins // len(records)) * len(records) - bins  # one per short rank, none else


@pytest.fixture(scope="module")
def full_run(packed, tmp_path_factory) -> tuple[Path, str]:
    """Two ranks, two dataloader workers each, two epochs, 2 micro-batches per step."""
    out = tmp_path_factory.mktemp("ddp-full")
    args = ["--manifest", str(packed), "--out", str(out / "ckpt"), "--workers", "2", "--grad-accum", "2"]
    stdout = torchrun(2, *args, "--epochs", "2", "--trace", str(out / "trace"), log=out / "log")
    return out / "trace", stdout


def test_bins_hold_images_and_videos_and_divide_by_no_world_size_used(packed):
    manifest = json.loads((packed / "manifest.json").read_text())
    bins = manifest["totals"]["bins"]
    assert bins % 2 and bins % 3, bins
    kinds = Counter()
    for shard in manifest["shards"]:
        media = pq.read_table(packed / shard["path"], columns=["media"]).column("media").to_pylist()
        kinds.update(item["kind"] for items in media for item in items)
    assert kinds["image"] >= 3 and kinds["video"] >= 1, kinds


def test_two_ranks_two_epochs_equal_steps_exactly_once(packed, full_run):
    trace, stdout = full_run
    records = read_trace(trace, 2)
    expected = expected_supervised(packed)
    for epoch in (0, 1):
        check_epoch(records, epoch, expected)
    orders = [[tuple(r["samples"]) for r in rank if r["epoch"] == e] for rank in records for e in (0, 1)]
    assert orders[0] != orders[1], "epochs are shuffled differently"
    assert "finished 2 epoch(s)" in stdout


def test_three_ranks_equal_steps_exactly_once(packed, tmp_path):
    args = ["--manifest", str(packed), "--out", str(tmp_path / "ckpt"), "--workers", "1", "--grad-accum", "3"]
    torchrun(3, *args, "--trace", str(tmp_path / "trace"), log=tmp_path / "log")
    check_epoch(read_trace(tmp_path / "trace", 3), 0, expected_supervised(packed))


def test_resume_mid_epoch_trains_exactly_the_rest(packed, full_run, tmp_path):
    args = ["--manifest", str(packed), "--out", str(tmp_path / "ckpt"), "--workers", "2", "--grad-accum", "2"]
    first = torchrun(2, *args, "--stop-after", "2", "--trace", str(tmp_path / "first"), log=tmp_path / "log1")
    assert "stopped after step 2" in first
    torchrun(2, *args, "--resume", "--trace", str(tmp_path / "rest"), log=tmp_path / "log2")
    before, after = read_trace(tmp_path / "first", 2), read_trace(tmp_path / "rest", 2)
    assert all(len(rank) == 4 for rank in before)  # 2 steps × 2 micro-batches, per rank
    assert all(r["step"] >= 2 for rank in after for r in rank)
    joined = [b + a for b, a in zip(before, after, strict=True)]
    check_epoch(joined, 0, expected_supervised(packed))
    uninterrupted = read_trace(full_run[0], 2)
    for rank in range(2):  # the very same micro-batches, in the same order, as without the stop
        same = [r["samples"] for r in uninterrupted[rank] if r["epoch"] == 0]
        assert [r["samples"] for r in joined[rank]] == same
    counts = Counter(s for rank in after for r in rank for s in r["samples"])
    assert counts and max(counts.values()) == 1


def test_a_qwen3_vl_model_trains_on_its_family_shards_exactly_once(family_run, tmp_path):
    """``--model tiny-qwen3_vl`` on shards tokenized from a Qwen3-VL model directory: 2 ranks."""
    packed = family_run("qwen3_vl").output / "packed"
    args = ["--manifest", str(packed), "--model", "tiny-qwen3_vl", "--out", str(tmp_path / "ckpt")]
    torchrun(
        2,
        *args,
        "--workers",
        "1",
        "--grad-accum",
        "2",
        "--trace",
        str(tmp_path / "trace"),
        log=tmp_path / "log",
    )
    check_epoch(read_trace(tmp_path / "trace", 2), 0, expected_supervised(packed))


def test_a_hybrid_model_without_its_kernels_is_refused_before_training(family_run, tmp_path):
    packed = family_run("qwen3_5").output / "packed"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(EXAMPLE),
    ]
    args = ["--manifest", str(packed), "--model", "tiny-qwen3_5", "--out", str(tmp_path / "ckpt")]
    done = subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0
    assert "install flash-linear-attention and causal-conv1d" in done.stdout + done.stderr
    assert not (tmp_path / "ckpt").exists()
