"""examples/train_qwen2_vl.py under torchrun: real DDP (gloo, CPU processes), a tiny random
Qwen2-VL, demo shards with images and videos whose bin count no world size here divides.

What must hold: the run ends (a hang at an epoch end is a timeout, and fails), every rank
runs the same number of micro-batches, every real sample's supervised tokens are trained
exactly once per epoch, and a resume from a mid-epoch checkpoint trains exactly the rest.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import PARITY_BUDGET, TILED_PARITY_BUDGET
from tests.examples.torchrun import (
    MANUAL,
    ROOT,
    TIMEOUT_S,
    check_epoch,
    expected_supervised,
    joined_after_resume,
    read_trace,
    torchrun,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def full_run(packed, tmp_path_factory) -> tuple[Path, str, Path]:
    """Two ranks, two dataloader workers each, two epochs, 2 micro-batches per step, a
    checkpoint every 2 steps (the resume test starts from its step 2)."""
    out = tmp_path_factory.mktemp("ddp-full")
    args = ["--manifest", str(packed), "--out", str(out / "ckpt"), "--workers", "2", "--grad-accum", "2"]
    stdout = torchrun(
        MANUAL, 2, *args, "--epochs", "2", "--save-every", "2", "--trace", str(out / "trace"), log=out / "log"
    )
    return out / "trace", stdout, out / "ckpt"


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
    trace, stdout, _ = full_run
    records = read_trace(trace, 2)
    expected = expected_supervised(packed)
    for epoch in (0, 1):
        check_epoch(records, epoch, expected)
    orders = [
        [tuple(s for s, _ in r["samples"]) for r in rank if r["epoch"] == e]
        for rank in records
        for e in (0, 1)
    ]
    assert orders[0] != orders[1], "epochs are shuffled differently"
    assert "finished 2 epoch(s)" in stdout


def test_the_loss_per_dataset_covers_every_supervised_token_of_each_step(packed, full_run):
    trace, stdout, _ = full_run
    records = [r for rank in read_trace(trace, 2) for r in rank]
    datasets = json.loads((packed / "manifest.json").read_text())["datasets"]
    for epoch, step in {(r["epoch"], r["step"]) for r in records}:
        mine = [r for r in records if (r["epoch"], r["step"]) == (epoch, step)]
        logged = mine[0]["datasets"]  # all-reduced: the same on every rank and micro-batch
        assert all(r["datasets"] == logged for r in mine) and set(logged) <= set(datasets)
        for name in datasets:  # its tokens are those of its samples in the step, on every rank
            trained = sum(t for r in mine for s, t in r["samples"] if expected_dataset(packed)[s] == name)
            assert logged.get(name, [0, 0])[1] == trained
    assert any(f"({name} " in stdout or f", {name} " in stdout for name in datasets)  # printed per dataset


@functools.cache
def expected_dataset(packed: Path) -> dict[str, str]:
    """Each sample id's dataset, from the shards."""
    found = {}
    for shard in json.loads((packed / "manifest.json").read_text())["shards"]:
        table = pq.read_table(packed / shard["path"], columns=["sample_ids", "sample_datasets"])
        names = zip(table["sample_ids"].to_pylist(), table["sample_datasets"].to_pylist(), strict=True)
        for ids, datasets in names:
            found.update(zip(ids, datasets, strict=True))
    return found


def test_three_ranks_equal_steps_exactly_once(packed, tmp_path):
    args = ["--manifest", str(packed), "--out", str(tmp_path / "ckpt"), "--workers", "1", "--grad-accum", "3"]
    torchrun(MANUAL, 3, *args, "--trace", str(tmp_path / "trace"), log=tmp_path / "log")
    check_epoch(read_trace(tmp_path / "trace", 3), 0, expected_supervised(packed))


def test_resume_mid_epoch_trains_exactly_the_rest(packed, full_run, tmp_path):
    """``--resume`` from the full run's checkpoint after step 2 of epoch 0's 3 (the same
    checkpoint ``--stop-after 2`` writes: test_training_install runs that flag) trains exactly
    the rest, in the micro-batches of the run without a stop."""
    trace, _, checkpoints = full_run
    shutil.copytree(checkpoints / "step-2", tmp_path / "ckpt" / "step-2")
    (tmp_path / "ckpt" / "latest").write_text("step-2")
    args = ["--manifest", str(packed), "--out", str(tmp_path / "ckpt"), "--workers", "2", "--grad-accum", "2"]
    torchrun(MANUAL, 2, *args, "--resume", "--trace", str(tmp_path / "rest"), log=tmp_path / "log")
    after = read_trace(tmp_path / "rest", 2)
    assert all(r["epoch"] == 0 and r["step"] >= 2 for rank in after for r in rank)
    joined = joined_after_resume(read_trace(trace, 2), after, resumed_at=2, grad_accum=2)
    check_epoch(joined, 0, expected_supervised(packed))  # with the above: all of epoch 0, as without the stop
    counts = Counter(s for rank in after for r in rank for s, _ in r["samples"])
    assert counts and max(counts.values()) == 1


def test_a_qwen3_vl_model_trains_on_its_family_shards_exactly_once(family_run, tmp_path):
    """``--model tiny-qwen3_vl`` on shards tokenized from a Qwen3-VL model directory, in the
    parity tests' small bins (a step's cost is its tokens times the real vocabulary): 2 ranks."""
    packed = family_run("qwen3_vl", PARITY_BUDGET).output / "packed"
    args = ["--manifest", str(packed), "--model", "tiny-qwen3_vl", "--out", str(tmp_path / "ckpt")]
    torchrun(
        MANUAL,
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


@pytest.mark.parametrize("family", ["internvl", "llava_onevision"])
def test_a_tiled_model_trains_on_its_family_shards_exactly_once(family_run, tmp_path, family):
    """``--model tiny-internvl`` (transformers-native InternVL, no boundary kwargs in its batches),
    ``tiny-llava_onevision`` (anyres crops, image sizes, images per sample) on shards tokenized
    from the family's model directory, in the parity tests' bins: 2 ranks, every sample once."""
    packed = family_run(family, TILED_PARITY_BUDGET).output / "packed"
    args = ["--manifest", str(packed), "--model", f"tiny-{family}", "--out", str(tmp_path / "ckpt")]
    torchrun(MANUAL, 2, *args, "--workers", "1", "--trace", str(tmp_path / "trace"), log=tmp_path / "log")
    check_epoch(read_trace(tmp_path / "trace", 2), 0, expected_supervised(packed))


def test_a_hybrid_model_without_its_kernels_is_refused_before_training(family_run, tmp_path):
    packed = family_run("qwen3_5").output / "packed"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(MANUAL),
    ]
    args = ["--manifest", str(packed), "--model", "tiny-qwen3_5", "--out", str(tmp_path / "ckpt")]
    done = subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0
    assert "install flash-linear-attention and causal-conv1d" in done.stdout + done.stderr
    assert not (tmp_path / "ckpt").exists()


def test_fsdp2_keeps_every_family_in_step_with_a_media_less_micro_batch(family_run, tmp_path):
    """FSDP2 on 2 ranks for a tiny InternVL, LLaVA-OneVision, Gemma 3, Gemma 4, GLM-V, Qwen2-Audio,
    Qwen2.5-Omni and Qwen3-Omni thinker: on each step one rank's micro-batch has media and the other's none
    (then the other way round). The media-less rank adds its family's idle media, so both call the
    vision (audio) towers alike: the steps complete (a hang is a timeout) and every weight stays
    finite. The families' small-bin packs (those of the parity tests): the media bin is the
    smallest."""
    families = {  # model type: (its family run, the pack's bin budget)
        "internvl": ("internvl", TILED_PARITY_BUDGET),
        "llava_onevision": ("llava_onevision", TILED_PARITY_BUDGET),
        "gemma3": ("gemma3", PARITY_BUDGET),
        "gemma4": ("gemma4", PARITY_BUDGET),
        "glm4v": ("glm4v", PARITY_BUDGET),
        "qwen2_audio": ("qwen2_audio", PARITY_BUDGET),
        "qwen2_5_omni_thinker": ("qwen2_5_omni", PARITY_BUDGET),
        "qwen3_omni_moe_thinker": ("qwen3_omni", PARITY_BUDGET),
    }
    args = [f"{t}={family_run(name, budget).output / 'packed'}" for t, (name, budget) in families.items()]
    stdout = torchrun(ROOT / "tests" / "examples" / "fsdp_idle_probe.py", 2, *args, log=tmp_path / "log")
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"model_type"')]
    assert [r["model_type"] for r in results] == list(families)
    for result in results:
        kinds = {
            "llava_onevision": ["image", "video"],
            "gemma4": ["image", "video"],
            "qwen2_audio": ["audio"],
            "qwen2_5_omni_thinker": ["image", "video", "audio"],
            "qwen3_omni_moe_thinker": ["image", "video", "audio"],
        }.get(result["model_type"], ["image"])
        for rank in result["ranks"]:
            assert rank["finite"]
            # the media bin has images or clips (LLaVA-OneVision's smallest no video): idle media
            # only where missing
            assert rank["idle_media"][1 - rank["rank"]] == kinds  # the text-only step: a full idle set
            assert kinds[0] not in rank["idle_media"][rank["rank"]]
            assert all(tokens >= 1 for tokens in rank["tokens"])
