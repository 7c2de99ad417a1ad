"""DPO with transformers' ``Trainer`` on a preference pack (``loader.trainer.PackedDPOTrainer``,
driven by examples/train_dpo.py) under torchrun: 2 CPU ranks (gloo), a tiny random Qwen2-VL
as policy and frozen reference, the preference demo's shards (pairs with images and videos),
gradient accumulation 2, two epochs.

What must hold: the run ends; both ranks run the same steps; every pair is trained exactly
once per epoch, as traced from inside Trainer's training step, both sides together; the
first step's loss is log 2 (the policy starts as the reference) and later ones move.
"""

from __future__ import annotations

import ast
import json
import math
from collections import Counter

import pyarrow.parquet as pq
import pytest

from tests.examples.torchrun import ROOT, check_epoch, expected_supervised, read_trace, torchrun

pytestmark = [pytest.mark.spark, pytest.mark.slow]

DPO = ROOT / "examples" / "train_dpo.py"


@pytest.fixture(scope="module")
def dpo_run(preference_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo-train")
    packed = preference_run.output / "packed"
    args = ["--manifest", str(packed), "--out", str(out / "ckpt"), "--workers", "1", "--grad-accum", "2",
            "--epochs", "2", "--lr", "1e-3", "--trace", str(out / "trace")]  # fmt: skip
    stdout = torchrun(DPO, 2, *args, log=out / "log")
    return packed, read_trace(out / "trace", 2), stdout


def shard_pairs(packed) -> Counter:
    manifest = json.loads((packed / "manifest.json").read_text())
    pairs = Counter()
    for shard in manifest["shards"]:
        for ids in pq.read_table(packed / shard["path"], columns=["sample_ids"])["sample_ids"].to_pylist():
            pairs.update(zip(ids[0::2], ids[1::2], strict=True))
    return pairs


def test_every_pair_is_trained_once_per_epoch_on_equal_steps(dpo_run):
    packed, records, stdout = dpo_run
    expected = shard_pairs(packed)
    assert len(expected) >= 30
    for epoch in (0, 1):
        check_epoch(records, epoch, expected_supervised(packed))  # every sequence once, equal steps
        traced = Counter(
            tuple(p) for rank in records for r in rank if r["epoch"] == epoch for p in r["pairs"]
        )
        assert traced == expected
    assert [r["step"] for r in records[0]] == [r["step"] for r in records[1]]
    assert "finished 2 epoch(s)" in stdout


def test_the_first_step_is_log_2_and_the_loss_moves(dpo_run):
    _, _, stdout = dpo_run
    logs = [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{'loss'")]
    assert len(logs) >= 4
    losses = [float(log["loss"]) for log in logs]
    assert abs(losses[0] - math.log(2)) < 1e-4  # policy == reference: every pair's loss is log 2
    assert float(logs[0]["rewards/accuracy"]) == 0.0 and float(logs[0]["rewards/margin"]) == 0.0
    assert min(losses[1:]) < math.log(2) - 1e-3  # training lowers it
