"""LLaVA-OneVision (``model_type: llava_onevision``) from its model directory, against transformers
on the same files: every tokenized sample's ids, labels and tokens per item (LlavaOnevisionProcessor,
its PIL image processor with the sample's images as one sample, LlavaOnevisionVideoProcessor);
every packed sample's crops, image sizes, images per sample and video frames; and a tiny random
LlavaOnevisionForConditionalGeneration giving each packed sample the logits and loss it gets
alone (SDPA, eager).

The directory holds the published processor configs and chat template (tests/models/build.py)
and a test-only video processor config sampling 4 frames a clip (LLaVA-OneVision stacks a
batch's videos, so mmpack packs videos only with a fixed frame count).
"""

from __future__ import annotations

import functools
import itertools
import json

import numpy as np
import pytest
import torch

from loader import PackedDataset, collate_packed
from mmpack_udfs.io import tables
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.validate import stage as validate
from tests.conftest import TILED_PARITY_BUDGET
from tests.integration.test_family_tokens import oracle_references
from tests.loader.test_model_parity import (
    KERNEL_CALLS,
    alone_1d,
    assert_each_sample_alone,
    register_attentions,
    text_calls,
    with_attention,
)
from tests.models.build import tiny_models
from tests.oracles import llava_onevision as oracle

pytestmark = pytest.mark.spark

IMAGE, VIDEO = 151646, 151647


@pytest.fixture(scope="module")
def llava(family_run, tmp_path_factory):
    """The run, its tokenized rows, transformers' reference of every row and of every video."""
    run = family_run("llava_onevision")
    rows, refs, videos = oracle_references(run, oracle, tmp_path_factory.mktemp("llava-videos"))
    return run, rows, refs, videos


def test_every_sample_has_the_ids_labels_and_tokens_transformers_gives(llava):
    run, rows, refs, videos = llava
    assert run.ctx.config.profile.kind == "llava_onevision"
    assert len(rows) >= 40
    shapes = {"anyres": 0, "in_set": 0, "video": 0}
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        assert [m["num_tokens"] for m in row["media"]] == ref["tokens"], row["sample_id"]
        for m in row["media"]:
            if m["kind"] == "video":
                assert m["frame_indices"] == videos[m["uri"]]["frame_indices"]
                shapes["video"] += 1
            else:
                shapes["anyres" if m["grid_h"] else "in_set"] += 1
    # single images cut into anyres crops, images of multi-image samples, videos: all seen
    assert shapes["anyres"] >= 20 and shapes["in_set"] >= 5 and shapes["video"] >= 3, shapes


def test_samples_whose_template_moves_their_media_are_kept_in_its_order(llava):
    """A turn that writes a video before an image: the template writes the image first, and so does
    mmpack (its ids are checked above); none is quarantined, and the summary counts them."""
    run, rows, _, _ = llava
    samples = {
        s["sample_id"]: s for s in tables.read_arrow(table_uri(str(run.output), "samples")).to_pylist()
    }
    moved = [
        r
        for r in rows
        if [m["kind"] for m in r["media"]] != [m["kind"] for m in samples[r["sample_id"]]["media"]]
    ]
    assert moved and all(r["media"][0]["kind"] == "image" for r in moved)
    quarantined = tables.read_arrow(table_uri(str(run.output), "tokenize_quarantine")).to_pylist()
    assert "template_refuses" not in {q["reason"] for q in quarantined}
    summary = json.loads((run.output / "report" / "tokenize.json").read_text())
    assert summary["counts"]["reordered"] == len(moved)


def sample_inputs(batch, cu: list[int], crops_of: dict[str, list[int]], sample_ids) -> list[dict]:
    """Each sample's own vision inputs, cut out of the batch in order: its crops, image sizes,
    image count and videos."""
    ids, out = batch["input_ids"][0], []
    crop, image, video = 0, 0, 0
    for (a, b), sample_id in zip(itertools.pairwise(cu), sample_ids, strict=True):
        mine: dict = {}
        crops = crops_of[sample_id]
        if crops:
            mine["pixel_values"] = batch["pixel_values"][crop : crop + sum(crops)]
            mine["image_sizes"] = batch["image_sizes"][image : image + len(crops)]
            mine["batch_num_images"] = torch.tensor([len(crops)])
            crop, image = crop + sum(crops), image + len(crops)
        if (ids[a:b] == VIDEO).any():
            count = int((ids[a:b] == VIDEO).sum())
            frames = batch["pixel_values_videos"].shape[1]
            n = count // (frames * 196 + 1)
            mine["pixel_values_videos"] = batch["pixel_values_videos"][video : video + n]
            video += n
        out.append(mine)
    assert crop == len(batch.get("pixel_values", ())) and video == len(batch.get("pixel_values_videos", ()))
    return out


def crops_per_sample(rows: list[dict]) -> dict[str, list[int]]:
    """Each sample's crops per image, from its tokenized media rows (grid (1, r, c): 1 + r·c)."""
    return {
        r["sample_id"]: [m["grid_t"] + m["grid_h"] * m["grid_w"] for m in r["media"] if m["kind"] == "image"]
        for r in rows
    }


def test_packed_samples_have_transformers_pixels_sizes_and_positions(llava):
    run, rows, refs, _ = llava
    crops_of = crops_per_sample(rows)
    checked = {"image": 0, "video": 0}
    for bin_ in PackedDataset(str(run.output / "packed"), shuffle=False):
        batch = collate_packed([bin_])
        cu = batch.meta["cu_seq_lens"]
        assert batch["position_ids"].shape == (1, cu[-1])
        inputs = sample_inputs(batch, cu, crops_of, bin_["sample_ids"])
        for (a, b), sample_id, mine in zip(itertools.pairwise(cu), bin_["sample_ids"], inputs, strict=True):
            ref = refs[sample_id]
            assert batch["input_ids"][0, a:b].tolist() == ref["input_ids"]
            assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
            kinds = [m["kind"] for m in next(r for r in rows if r["sample_id"] == sample_id)["media"]]
            images = [p for p, k in zip(ref["pixel_values"], kinds, strict=True) if k == "image"]
            clips = [p for p, k in zip(ref["pixel_values"], kinds, strict=True) if k == "video"]
            if images:
                got = mine["pixel_values"].numpy()
                np.testing.assert_allclose(got, np.concatenate(images), rtol=0, atol=1e-6)
                assert mine["image_sizes"].tolist() == ref["image_sizes"]
                assert mine["batch_num_images"].tolist() == ref["batch_num_images"]
                checked["image"] += 1
            if clips:
                got = mine["pixel_values_videos"].numpy()
                np.testing.assert_allclose(got, np.stack(clips), rtol=0, atol=1e-6)
                checked["video"] += 1
    assert checked["image"] >= 20 and checked["video"] >= 3, checked


@pytest.fixture(scope="module")
def micro_batches(llava, family_run) -> list[list[dict]]:
    """Small multi-sample bins: an image bin beside a video bin, and a bin with a multi-image
    sample (read once for every attention)."""
    packed, rows = family_run("llava_onevision", TILED_PARITY_BUDGET).output / "packed", llava[1]
    videos = {r["sample_id"] for r in rows if any(m["kind"] == "video" for m in r["media"])}
    multi = {r["sample_id"] for r in rows if sum(m["kind"] == "image" for m in r["media"]) > 1}
    bins = [b for b in PackedDataset(str(packed), shuffle=False) if len(b["sample_ids"]) > 1]
    bins.sort(key=lambda b: len(b["input_ids"]))
    video = next(b for b in bins if videos & set(b["sample_ids"]))
    several = next(b for b in bins if multi & set(b["sample_ids"]) and not videos & set(b["sample_ids"]))
    image = next(b for b in bins if "pixel_values" in b and not (videos | multi) & set(b["sample_ids"]))
    return [[image, video], [several]]


@pytest.mark.parametrize("attention", ["sdpa", "eager", "mmpack_varlen"])
def test_packed_equals_each_sample_alone(llava, micro_batches, attention):
    rows = llava[1]
    register_attentions()
    model = with_attention(tiny_models().tiny_model("llava_onevision", seed=3), attention)
    crops_of = crops_per_sample(rows)
    checked = 0
    for bins in micro_batches:
        batch = collate_packed(bins)
        KERNEL_CALLS.clear()
        with torch.no_grad():
            packed = model(**batch)
        if attention == "mmpack_varlen":  # the registered function took the batch's boundaries
            assert text_calls(batch.meta["cu_seq_lens"]) == model.config.text_config.num_hidden_layers
        sample_ids = [s for b in bins for s in b["sample_ids"]]
        media = sample_inputs(batch, batch.meta["cu_seq_lens"], crops_of, sample_ids)
        checked += assert_each_sample_alone(batch, packed, media, functools.partial(alone_1d, model))
    assert checked >= 6


def test_validate_accepts_the_shards(spark, llava):
    run = llava[0]
    summary = validate.run(spark, run.ctx)
    assert summary["ok"], summary["problems"]
    assert summary["source"]["rows"] == summary["samples"] + summary["skipped"]
