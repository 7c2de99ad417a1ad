"""loader.energon: mmpack exports read by Megatron-Energon's own loader (get_train_dataset,
get_savable_loader) on 2 ranks × 2 workers give every bin once per epoch, each as the batch
PackedDataset + megatron_batch give for it; a saved loader state resumes with exactly the rest
of the epoch; a metadataset blends exports without repacking."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from loader import PackedDataset
from loader.collate import VISION_INPUTS, collate_packed
from loader.energon import EqualSteps, MmpackTaskEncoder, epoch_loader, load_export, steps_per_rank
from loader.megatron import megatron_batch
from tests.loader.test_megatron import check_labels
from tests.models.build import tiny_models

pytestmark = pytest.mark.spark

WORLD, WORKERS = 2, 2
COMPARED = ("input_ids", "labels", "loss_mask", "position_ids", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "input_features",
            "feature_attention_mask")  # fmt: skip
GLM_VIDEO_START = tiny_models().GLM41V_IDS["video_start_token_id"]  # the glm4v directory's
BOUNDARIES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def energon_loader(
    path: Path, encoder: MmpackTaskEncoder, rank: int, world: int = WORLD, workers: int = WORKERS
):
    return epoch_loader(path, encoder, rank, world, workers)


def bin_key(batch: dict[str, Any]) -> tuple:
    meta = batch["meta"]
    return (tuple(sorted(meta["subflavors"].items())), meta["source"]["split"], meta["source"]["shard"],
            meta["source"]["row"])  # fmt: skip


def check_against_collate_packed(item: dict[str, Any], batch: dict[str, Any]) -> None:
    """megatron_batch's contract on a real bin: tokens, mRoPE rows and pixels are collate_packed's
    at the padded places, its labels the torch loader's shifted inside each sample."""
    reference = collate_packed([item])
    params = batch["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == reference.meta["cu_seq_lens"]
    starts, lengths = params.cu_seqlens_q_padded[:-1].tolist(), params.cu_seqlens_q.diff().tolist()
    place = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, lengths, strict=True)])
    assert torch.equal(batch["input_ids"][0, place], reference["input_ids"][0])
    assert torch.equal(batch["position_ids"][:, 0, place], reference["position_ids"][1:, 0, :])
    check_labels(item, batch)
    for key in VISION_INPUTS:
        assert (key in batch) == (key in reference), key
        if key in batch:
            assert torch.equal(batch[key], reference[key]), key
    if "second_per_grid_ts" in reference.meta:
        assert torch.equal(batch["second_per_grid_ts"], reference.meta["second_per_grid_ts"])


def test_every_bin_of_the_demo_once_across_ranks_and_workers_as_the_torch_loader_gives_it(energon_export):
    check_every_bin_once(energon_export("qwen2_vl"), "qwen2_vl")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "glm4v", "qwen2_5_omni", "qwen3_omni"])
def test_every_bin_once_across_ranks_and_workers_as_the_torch_loader_gives_it(family, family_export):
    check_every_bin_once(family_export(family), family)


def check_every_bin_once(export: Path, family: str) -> None:
    """Export → Energon on 2 ranks × 2 workers (CP 2, TP 2, sequence parallel): each bin once,
    equal to megatron_batch of PackedDataset's item, which is collate_packed's batch shifted
    and padded (images, and for Qwen2.5-VL videos with second_per_grid_ts; GLM-V: its videos'
    frames handed over as images, its 3-D positions; Qwen2.5-Omni: its clips' features and masks,
    its TMRoPE positions; Qwen3-Omni: the same, its float positions fractional)."""
    options = {"cp_size": 2, "tp_size": 2, "sequence_parallel": True}
    encoder = MmpackTaskEncoder(str(export), **options)
    got: dict[tuple, dict] = {}
    for rank in range(WORLD):
        for batch in energon_loader(export, encoder, rank):
            assert bin_key(batch) not in got, f"{batch['meta']['key']} came twice"
            got[bin_key(batch)] = batch
    manifest = load_export(str(export))
    assert len(got) == manifest["splits"]["train"]["bins"]

    by_ids = {tuple(b["meta"]["sample_ids"]): b for b in got.values()}
    assert len(by_ids) == len(got)
    videos = clips = 0
    fractional = False
    reference = PackedDataset(
        str(Path(manifest["source"]["output"]) / "packed"), shuffle=False, balance=False
    )
    for item in DataLoader(reference, batch_size=None, num_workers=2):  # both cores decode
        expected = megatron_batch(item, **options)
        check_against_collate_packed(item, expected)
        batch = by_ids.pop(tuple(item["sample_ids"]))
        for key in COMPARED:
            assert (key in batch) == (key in expected), key
            if key in batch:
                assert torch.equal(batch[key], expected[key]), key
        for name in BOUNDARIES:
            assert torch.equal(
                getattr(batch["packed_seq_params"], name), getattr(expected["packed_seq_params"], name)
            )
        assert batch["packed_seq_params"].max_seqlen_q == expected["packed_seq_params"].max_seqlen_q
        # GLM-V's videos reach the tower as images: a bin with one holds <|begin_of_video|>
        videos += "video_grid_thw" in batch or bool((batch["input_ids"] == GLM_VIDEO_START).any())
        clips += len(batch.get("input_features", []))
        fractional |= bool((batch["position_ids"] % 1).any())
    assert not by_ids and videos > 0
    assert clips == (4 if family.endswith("omni") else 0)  # the demo's clips, each once
    assert fractional == (family == "qwen3_omni")


def test_a_saved_state_resumes_with_exactly_the_rest_of_the_epoch(energon_export):
    export = energon_export("qwen2_vl")
    encoder = MmpackTaskEncoder(str(export), with_media=False)
    whole = [b["meta"]["key"] for b in energon_loader(export, encoder, rank=1)]
    loader = energon_loader(export, encoder, rank=1)
    batches = iter(loader)
    head = [next(batches)["meta"]["key"] for _ in range(3)]
    state = loader.save_state_rank()
    rest = [b["meta"]["key"] for b in batches]  # the interrupted loader goes on (and its workers end)
    resumed = energon_loader(export, encoder, rank=1)
    resumed.restore_state_rank(state)
    assert len(whole) > 4 and head + rest == whole
    assert [b["meta"]["key"] for b in resumed] == rest


def test_every_rank_takes_the_same_steps_and_fillers_train_nothing(energon_export):
    """Energon's shares differ between ranks; EqualSteps pads each rank to steps_per_rank with
    copies of its last bin whose labels are all masked, and resumes inside the fillers."""
    export = energon_export("qwen2_vl")
    encoder = MmpackTaskEncoder(str(export), with_media=False)
    world, workers = 3, 2
    steps = steps_per_rank(str(export), world, workers)
    bins = load_export(str(export))["splits"]["train"]["bins"]
    real, taken, padded_rank = Counter(), [], None
    for rank in range(world):
        batches = list(EqualSteps(energon_loader(export, encoder, rank, world, workers), steps))
        taken.append(len(batches))
        for batch in batches:
            if batch["meta"]["filler"]:
                assert batch["loss_mask"].sum() == 0 and (batch["labels"] == -100).all()
                assert batch["meta"]["sample_ids"] == [] and batch["input_ids"].numel() > 0
                padded_rank = rank
            else:
                real[batch["meta"]["key"]] += 1
    assert taken == [steps] * world and len(real) == bins == sum(real.values()) < steps * world
    equal = EqualSteps(energon_loader(export, encoder, padded_rank, world, workers), steps)
    batches = iter(equal)
    head = [next(batches) for _ in range(steps - 1)]
    state = equal.save_state_rank()
    rest = list(batches)
    resumed = EqualSteps(energon_loader(export, encoder, padded_rank, world, workers), steps)
    resumed.restore_state_rank(state)
    again = list(resumed)
    assert head[-1]["meta"]["filler"] and len(rest) == len(again) == 1 and again[0]["meta"]["filler"]
    assert torch.equal(again[0]["input_ids"], rest[0]["input_ids"])


def write_blend(folder: Path, entries: list[tuple[Path, int, str]]) -> Path:
    """A MetadatasetV2 of exports, each ``repetitions`` times in one epoch, tagged by subflavor."""
    lines = ["__module__: megatron.energon", "__class__: MetadatasetV2", "splits:", "  train:",
             "    blend_epochized:"]  # fmt: skip
    for path, repetitions, name in entries:
        lines += [
            f"      - repetitions: {repetitions}",
            f"        path: {path}",
            f"        subflavors: {{export: {name}}}",
        ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "blend.yaml").write_text("\n".join(lines) + "\n")
    return folder / "blend.yaml"


def test_a_metadataset_blends_exports_without_repacking(energon_export, tmp_path):
    demo, mixed = energon_export("qwen2_vl"), energon_export("mixed")
    blend = write_blend(tmp_path, [(demo, 2, "demo"), (mixed, 1, "mixed")])
    encoder = MmpackTaskEncoder(str(demo), with_media=False)
    seen = Counter()
    for rank in range(WORLD):
        seen.update(bin_key(b) for b in energon_loader(blend, encoder, rank))
    bins = {
        name: load_export(str(path))["splits"]["train"]["bins"]
        for name, path in (("demo", demo), ("mixed", mixed))
    }
    per_export = Counter(key[0][0][1] for key in seen.elements())
    assert per_export == {"demo": 2 * bins["demo"], "mixed": bins["mixed"]}
    assert set(seen.values()) == {1, 2} and all(seen[k] == 2 for k in seen if k[0][0][1] == "demo")


def test_a_blend_of_another_models_export_is_refused(family_export, tmp_path):
    blend = write_blend(tmp_path, [(family_export("qwen2_5_vl"), 1, "a"), (family_export("glm4v"), 1, "b")])
    encoder = MmpackTaskEncoder(str(family_export("glm4v")), with_media=False)
    with pytest.raises(
        ValueError, match=r"packed for another model \(profile 'model'.*a blend must mix exports of one model"
    ):
        for _ in energon_loader(blend, encoder, rank=0, world=1, workers=0):
            pass


def test_what_is_not_an_export_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no mmpack export"):
        MmpackTaskEncoder(str(tmp_path))
    (tmp_path / "mmpack_export.json").write_text(
        json.dumps({"format": "mmpack-energon", "format_version": 9})
    )
    with pytest.raises(ValueError, match="format version 1"):
        MmpackTaskEncoder(str(tmp_path))
