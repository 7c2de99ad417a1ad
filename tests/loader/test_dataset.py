"""PackedDataset over real packed demo shards: coverage, shuffles, resume, media, S3."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import PackedBatch, PackedDataset, ShardError, collate_packed
from mmpack_udfs import schemas
from mmpack_udfs.io import tables

pytestmark = pytest.mark.spark

IMAGE_PAD, VIDEO_PAD = 151655, 151656


def bin_key(item) -> tuple:
    return tuple(item["sample_ids"])


def read_epoch(
    packed_demo, world: int, workers: int, epoch: int = 0, balance: bool = True
) -> list[list[tuple]]:
    """Per rank, the bins it yields (a filler bin as ``("filler",)``)."""
    per_rank = []
    for rank in range(world):
        dataset = PackedDataset(
            str(packed_demo / "packed"), rank=rank, world_size=world, with_media=False, balance=balance
        )
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=None, num_workers=workers)
        per_rank.append([("filler",) if item["filler"] else bin_key(item) for item in loader])
        assert len(per_rank[-1]) == len(dataset)
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("balance", [True, False])
def test_every_bin_once_per_epoch_and_equal_steps(packed_demo, world, workers, balance):
    per_rank = read_epoch(packed_demo, world, workers, balance=balance)
    manifest = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    bins = manifest["totals"]["bins"]
    assert {len(rank) for rank in per_rank} == {-(-bins // world)}
    assert sum(rank.count(("filler",)) for rank in per_rank) == -(-bins // world) * world - bins
    seen = [key for rank in per_rank for key in rank if key != ("filler",)]
    assert len(seen) == len(set(seen)) == bins
    samples = [s for key in seen for s in key]
    assert len(samples) == len(set(samples)) == manifest["totals"]["samples"]


def test_filler_is_a_real_bin_that_trains_nothing(packed_demo):
    bins = len(PackedDataset(str(packed_demo / "packed")))
    world = next(w for w in range(2, bins) if bins % w)  # the last rank is one bin short
    dataset = PackedDataset(str(packed_demo / "packed"), rank=world - 1, world_size=world, with_media=False)
    fillers = [item for item in dataset if item["filler"]]
    assert len(fillers) == 1
    filler = fillers[0]
    assert filler["sample_ids"] == [] and filler["labels"].eq(-100).all()
    assert len(filler["input_ids"]) == int(filler["cu_seqlens"][-1]) > 0


def test_drop_remainder_gives_equal_real_bins(packed_demo):
    lengths = []
    for rank in range(4):
        dataset = PackedDataset(str(packed_demo / "packed"), rank=rank, world_size=4, drop_remainder=True)
        items = list(DataLoader(dataset, batch_size=None, num_workers=2))
        assert not any(item["filler"] for item in items) and len(items) == len(dataset)
        lengths.append(len(items))
    assert set(lengths) == {PackedDataset(str(packed_demo / "packed")).__len__() // 4}


@pytest.mark.parametrize(("world", "workers", "bins_per_step"), [(2, 2, 2), (4, 3, 1), (3, 0, 3)])
def test_dataloader_steps_are_equal_on_every_rank(packed_demo, world, workers, bins_per_step):
    steps = []
    for rank in range(world):
        dataset = PackedDataset(str(packed_demo / "packed"), rank=rank, world_size=world, with_media=False)
        loader = DataLoader(dataset, batch_size=bins_per_step, collate_fn=collate_packed, num_workers=workers)
        batches = list(loader)  # collated in worker processes: .meta crosses the process boundary
        assert all(isinstance(b, PackedBatch) and 1 <= b.meta["num_bins"] <= bins_per_step for b in batches)
        steps.append(len(batches))
        assert steps[-1] == dataset.num_batches(bins_per_step, workers)
    assert len(set(steps)) == 1


@pytest.mark.parametrize("balance", [True, False])
def test_shuffle_differs_across_epochs_and_repeats(packed_demo, balance):
    first = read_epoch(packed_demo, 2, 0, epoch=0, balance=balance)
    assert first == read_epoch(packed_demo, 2, 0, epoch=0, balance=balance)
    second = read_epoch(packed_demo, 2, 0, epoch=1, balance=balance)
    assert first != second
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1])


@pytest.mark.parametrize(("workers", "stop_after", "balance"), [(0, 5, True), (2, 3, True), (3, 7, False)])
def test_resume_mid_epoch_yields_exactly_the_rest(packed_demo, workers, stop_after, balance):
    def loader():
        ds = PackedDataset(
            str(packed_demo / "packed"),
            seed=5,
            shuffle_buffer=3,
            with_media=False,
            rank=1,
            world_size=2,
            balance=balance,
        )
        ds.set_epoch(2)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    full = [bin_key(b) for b in loader()]
    first = loader()
    taken, state = [], None
    for i, item in enumerate(first):
        taken.append(bin_key(item))
        if i + 1 == stop_after:
            state = first.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [bin_key(b) for b in resumed]
    assert taken + rest == full


def test_balance_is_on_when_a_cost_index_exists_and_needs_one(packed_demo, tmp_path):
    assert PackedDataset(str(packed_demo / "packed")).balance
    copy = tmp_path / "packed"
    shutil.copytree(packed_demo / "packed", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["cost_index"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert not PackedDataset(str(copy)).balance  # an older pack: today's order
    with pytest.raises(ValueError, match="needs a cost index"):
        PackedDataset(str(copy), balance=True)


def test_a_resume_state_names_the_balance_it_was_saved_with(packed_demo):
    saved = PackedDataset(str(packed_demo / "packed"), with_media=False)
    state = saved.state_dict()
    other = PackedDataset(str(packed_demo / "packed"), with_media=False, balance=False)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="balance"):
        next(iter(other))


def test_bins_match_the_tokenized_rows_and_vision_counts(packed_demo):
    rows = {
        r["sample_id"]: r
        for r in tables.read_arrow(schemas.table_uri(str(packed_demo), "tokenized")).to_pylist()
    }
    with_media = 0
    for item in PackedDataset(str(packed_demo / "packed"), shuffle=False):
        cu = item["cu_seqlens"].tolist()
        assert item["cu_seqlens"].dtype == torch.int32 and cu[-1] == len(item["input_ids"])
        assert item["max_seqlen"] == max(b - a for a, b in itertools.pairwise(cu))
        for i, sid in enumerate(item["sample_ids"]):
            a, b = cu[i], cu[i + 1]
            assert item["input_ids"][a:b].tolist() == rows[sid]["input_ids"]
            labels = rows[sid]["labels"]
            assert item["labels"][a:b].tolist() == [-100, *labels[1:]]
            assert item["position_ids"][a:b].tolist() == list(range(b - a))
        ids = item["input_ids"]
        images, videos = int((ids == IMAGE_PAD).sum()), int((ids == VIDEO_PAD).sum())
        assert item.get("pixel_values", torch.zeros(0, 1176)).shape[0] // 4 == images
        assert item.get("pixel_values_videos", torch.zeros(0, 1176)).shape[0] // 4 == videos
        if "image_grid_thw" in item:
            assert int(item["image_grid_thw"].prod(-1).sum()) == item["pixel_values"].shape[0]
        assert item["mrope_position_ids"].shape == (3, len(ids))
        with_media += images + videos > 0
    assert with_media > 0


def test_mrope_without_pixels_is_exact(packed_demo):
    with_pixels = list(PackedDataset(str(packed_demo / "packed"), shuffle=False))
    without = list(PackedDataset(str(packed_demo / "packed"), shuffle=False, with_media=False))
    assert len(with_pixels) == len(without)
    differs_from_plain = 0
    for a, b in zip(with_pixels, without, strict=True):
        assert "pixel_values" not in b and "pixel_values_videos" not in b
        assert torch.equal(a["mrope_position_ids"], b["mrope_position_ids"])
        differs_from_plain += not torch.equal(b["mrope_position_ids"][0], b["position_ids"])
    assert differs_from_plain > 0


def test_collate_concatenates_or_pads(packed_demo):
    items = list(PackedDataset(str(packed_demo / "packed"), shuffle=False, with_media=False))[:3]
    batch = collate_packed(items)
    total = sum(len(i["input_ids"]) for i in items)
    assert batch["input_ids"].shape == (1, total) and int(batch["cu_seq_lens_q"][-1]) == total
    assert batch["position_ids"].shape == (4, 1, total) and batch["use_cache"] is False
    assert len(batch["cu_seq_lens_q"]) == sum(len(i["cu_seqlens"]) - 1 for i in items) + 1
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and isinstance(batch["max_length_q"], int)
    assert batch.meta["num_tokens"] == total and batch.meta["num_bins"] == 3
    assert batch.meta["supervised_tokens"] == int((batch["labels"] != -100).sum())
    assert batch.meta["sample_ids"] == [s for i in items for s in i["sample_ids"]]
    assert batch.meta["bin_tokens"] == [len(i["input_ids"]) for i in items]
    lengths = [torch.diff(i["cu_seqlens"]).tolist() for i in items]
    assert batch.meta["bin_sum_sq_lengths"] == [sum(n * n for n in bin_lengths) for bin_lengths in lengths]
    padded = collate_packed(items, pad_to=total + 10)
    assert padded["input_ids"].shape == (1, total + 10) and padded["position_ids"].shape == (4, 1, total + 10)
    assert padded["position_ids"][:, 0, total:].tolist() == [list(range(10))] * 4
    assert padded["labels"][0, total:].eq(-100).all() and int(padded["cu_seq_lens_q"][-1]) == total + 10
    with pytest.raises(ValueError, match="do not fit"):
        collate_packed(items, pad_to=total - 1)


def test_corrupted_or_missing_shard_or_bad_version(packed_demo, tmp_path):
    copy = tmp_path / "packed"
    shutil.copytree(packed_demo / "packed", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    first = copy / manifest["shards"][0]["path"]
    data = bytearray(first.read_bytes())
    data[100] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=manifest["shards"][0]["path"]):
        list(PackedDataset(str(copy), shuffle=False, with_media=False))
    first.unlink()
    with pytest.raises(ShardError, match="missing"):
        list(PackedDataset(str(copy), shuffle=False, with_media=False))
    manifest["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="format version 99"):
        PackedDataset(str(copy))


def test_reads_from_s3(packed_demo, s3_bucket):
    import boto3

    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for path in (packed_demo / "packed").rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            client.upload_file(
                str(path), bucket, "run/" + path.relative_to(packed_demo / "packed").as_posix()
            )
    s3 = {"endpoint_override": endpoint, "scheme": "http", "region": "us-east-1"}
    local = [bin_key(b) for b in PackedDataset(str(packed_demo / "packed"), with_media=False)]
    remote = PackedDataset(f"s3://{bucket}/run", s3=s3, with_media=False)
    assert [bin_key(b) for b in DataLoader(remote, batch_size=None, num_workers=2)] != []
    assert [bin_key(b) for b in remote] == local

    manifest = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    key = "run/" + manifest["shards"][0]["path"]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[50] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(ShardError, match="does not match the manifest"):
        list(PackedDataset(f"s3://{bucket}/run", s3=s3, shuffle=False, with_media=False))
    client.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(ShardError, match=manifest["shards"][0]["path"]):
        list(PackedDataset(f"s3://{bucket}/run", s3=s3, shuffle=False, with_media=False))
