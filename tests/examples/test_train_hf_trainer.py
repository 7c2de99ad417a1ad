"""transformers' ``Trainer`` on mmpack shards (``loader.trainer.PackedTrainer``, driven by
examples/train_hf_trainer.py) under torchrun: 2 CPU ranks (gloo), a tiny random Qwen2-VL,
demo shards whose 11 bins neither 2 nor 3 divides, gradient accumulation 2, past an epoch
end. And FSDP2 through examples/train_qwen2_vl.py --fsdp with a rank whose micro-batch has
no media while the other's has.

What must hold: every run ends (a hang is a timeout, and fails); every rank runs the same
steps; every real sample's supervised tokens are trained exactly once per epoch, as traced
from inside Trainer's training step; the first optimizer step's loss and gradients are the
manual example's; a resume from a mid-epoch Trainer checkpoint trains exactly the rest of
the epoch, in the uninterrupted run's micro-batches and to its weights; ``--stop-after N``
saves a checkpoint and stops after step N.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from tests.examples.torchrun import (
    MANUAL,
    ROOT,
    TRAINER,
    check_epoch,
    expected_supervised,
    joined_after_resume,
    read_trace,
    torchrun,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]

PROBE = ROOT / "tests" / "examples" / "first_step_probe.py"


def trainer_args(packed, out, *extra: str) -> list[str]:
    return ["--manifest", str(packed), "--out", str(out), "--workers", "2", "--grad-accum", "2", *extra]


@pytest.fixture(scope="module")
def full_run(packed, tmp_path_factory):
    """Two ranks, two workers each, two epochs, 2 micro-batches per optimizer step, a
    checkpoint every 2 steps (the resume test starts from its step 2)."""
    out = tmp_path_factory.mktemp("trainer-full")
    saving = ["--epochs", "2", "--save-every", "2", "--trace", str(out / "trace")]
    args = trainer_args(packed, out / "ckpt", *saving)
    stdout = torchrun(TRAINER, 2, *args, log=out / "log")
    return out / "trace", stdout, out / "ckpt"


def test_trainer_two_ranks_two_epochs_equal_steps_exactly_once(packed, full_run):
    trace, stdout, _ = full_run
    records = read_trace(trace, 2)
    expected = expected_supervised(packed)
    for epoch in (0, 1):
        check_epoch(records, epoch, expected)
    steps = [[r["step"] for r in rank] for rank in records]
    assert steps[0] == steps[1]  # the same optimizer steps, micro-batch by micro-batch
    assert "finished 2 epoch(s), 6 steps" in stdout  # 6 micro-batches a rank per epoch, 2 per step


def test_trainer_resume_mid_epoch_trains_exactly_the_rest(packed, full_run, tmp_path):
    """Resumed through Trainer's resume_from_checkpoint from the full run's checkpoint after
    step 2 of epoch 0's 3, and stopped by ``--stop-after 4`` one step into epoch 1: the rest of
    epoch 0 and the next step, in the micro-batches of the uninterrupted run, and its weights
    at step 4."""
    trace, _, checkpoints = full_run
    shutil.copytree(checkpoints / "checkpoint-2", tmp_path / "ckpt" / "checkpoint-2")
    rest = ["--epochs", "2", "--resume", "--stop-after", "4", "--trace", str(tmp_path / "rest")]
    stdout = torchrun(TRAINER, 2, *trainer_args(packed, tmp_path / "ckpt", *rest), log=tmp_path / "log")
    assert "stopped after step 4" in stdout
    stopped = tmp_path / "ckpt" / "checkpoint-4"
    assert sorted(p.name for p in stopped.glob("mmpack-loader-rank*.pt")) == [
        "mmpack-loader-rank0.pt",
        "mmpack-loader-rank1.pt",
    ]
    after = read_trace(tmp_path / "rest", 2)
    assert all([r["step"] for r in rank] == [2, 2, 3, 3] for rank in after)
    joined = joined_after_resume(read_trace(trace, 2), after, resumed_at=2, grad_accum=2)
    check_epoch(joined, 0, expected_supervised(packed))
    resumed, whole = (load_file(d / "model.safetensors") for d in (stopped, checkpoints / "checkpoint-4"))
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[name], whole[name]) for name in whole), "weights differ after the resume"


def test_trainer_first_step_equals_the_manual_example(packed, tmp_path):
    stdout = torchrun(PROBE, 2, str(packed), str(tmp_path / "out"), log=tmp_path / "log")
    record = json.loads(next(line for line in stdout.splitlines() if line.startswith('{"manual_loss"')))
    assert abs(record["trainer_loss"] - record["manual_loss"]) <= 1e-5 * record["manual_loss"], record
    assert record["max_grad_difference"] <= 1e-5, record
    assert record["with_gradient"] > 0.9 * record["parameters"], record


def test_trainer_refuses_persistent_workers_and_a_mismatched_dataset(packed, tmp_path):
    script = f"""
import torch
from transformers import TrainingArguments
from loader import PackedDataset
from loader.trainer import PackedTrainer
import importlib.util
spec = importlib.util.spec_from_file_location("m", {str(MANUAL)!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
model = m.load_model("tiny", 0, "sdpa", torch.device("cpu"))
for kwargs, dataset in (({{"dataloader_persistent_workers": True, "dataloader_num_workers": 1}}, None),
                        ({{}}, PackedDataset({str(packed)!r}, rank=1, world_size=2))):
    args = TrainingArguments({str(tmp_path)!r}, use_cpu=True, report_to="none", **kwargs)
    try:
        PackedTrainer(model=model, args=args, manifest={str(packed)!r}, train_dataset=dataset)
    except ValueError as err:
        print("refused:", err)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    refusals = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, done.stdout
    assert "dataloader_persistent_workers" in refusals[0]
    assert "rank 1 of 2" in refusals[1] and "rank 0 of 1" in refusals[1]


def test_fsdp2_with_a_media_less_micro_batch_on_one_rank(packed_text_and_images, tmp_path):
    """FSDP2 (fully_shard on decoder layers and vision blocks) all-gathers the vision tower's
    parameters in step on every rank: a rank whose micro-batch has no image would leave the
    others waiting. The example gives such a micro-batch a masked idle image."""
    args = ["--manifest", str(packed_text_and_images), "--out", str(tmp_path / "ckpt"), "--fsdp"]
    stdout = torchrun(
        MANUAL, 2, *args, "--workers", "0", "--grad-accum", "1", "--trace", str(tmp_path / "trace"),
        log=tmp_path / "log",
    )  # fmt: skip
    records = read_trace(tmp_path / "trace", 2)
    assert len(records[0]) == len(records[1]) >= 3
    mixed = [a["step"] for a, b in zip(*records, strict=True) if a["media"] != b["media"]]
    assert mixed, "no step where one rank had media and the other none"
    check_epoch(records, 0, expected_supervised(packed_text_and_images))
    assert "finished 1 epoch(s)" in stdout
    counts = Counter(s for rank in records for r in rank for s, _ in r["samples"])
    assert max(counts.values()) == 1
