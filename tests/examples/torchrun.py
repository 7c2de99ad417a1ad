"""Running the training examples under torchrun and reading their traces: shared by the
tests of examples/train_qwen2_vl.py and examples/train_hf_trainer.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
MANUAL = ROOT / "examples" / "train_qwen2_vl.py"
TRAINER = ROOT / "examples" / "train_hf_trainer.py"
TIMEOUT_S = 900


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


def torchrun(script: Path, world: int, *args: str, log: Path) -> str:
    """Run ``script`` under torchrun, output in ``log``. A run still going after TIMEOUT_S (a
    hang) fails the test; torchrun is stopped with SIGTERM, which its agent passes on to
    every rank (ranks run in sessions of their own), then killed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*command, str(script), *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
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
            for sample, tokens in record["samples"]:
                trained[sample].append(tokens)
    assert {s: t for s, t in trained.items() if len(t) > 1} == {}, "samples trained twice"
    assert {s: t[0] for s, t in trained.items()} == expected
    bins = len({tuple(s for s, _ in r["samples"]) for rank in per_rank for r in rank if r["samples"]})
    fillers = sum(r["fillers"] for rank in per_rank for r in rank)
    assert fillers == -(-bins // len(records)) * len(records) - bins  # one per short rank, none else


def joined_after_resume(
    uninterrupted: list[list[dict]], after: list[list[dict]], resumed_at: int, grad_accum: int
) -> list[list[dict]]:
    """Per rank, the uninterrupted run's micro-batches before optimizer step ``resumed_at`` of
    epoch 0, then those of a run resumed from that step's checkpoint. Each rank's must be the
    very same micro-batches, in the same order, as the uninterrupted run's."""
    before = [[r for r in rank if r["epoch"] == 0 and r["step"] < resumed_at] for rank in uninterrupted]
    assert all(len(rank) == resumed_at * grad_accum for rank in before)
    joined = [b + a for b, a in zip(before, after, strict=True)]
    for mine, theirs in zip(joined, uninterrupted, strict=True):
        assert [r["samples"] for r in mine] == [r["samples"] for r in theirs[: len(mine)]]
    return joined
