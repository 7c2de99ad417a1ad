"""transformers-native InternVL (``model_type: internvl``, the ``-hf`` checkpoints) from its model
directory, against transformers on the same files: every tokenized sample's ids, labels, tiles
and video frames (InternVLProcessor, GotOcr2 image processor, InternVLVideoProcessor); every
packed sample's pixel values; and a tiny random InternVLForConditionalGeneration giving each
packed sample the logits and loss it gets alone (SDPA, eager, the flash-attn convention).

The directory holds the published processor configs and chat template (tests/models/build.py)
and, for the demo's clips to fit the test budget, a video processor config that samples 4
frames a clip (every-frame videos: tests/mmpack_udfs/families/test_internvl.py).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from loader import PackedDataset, collate_packed
from mmpack_udfs.validate import stage as validate
from tests.conftest import TILED_PARITY_BUDGET
from tests.integration.test_family_tokens import oracle_references
from tests.loader.test_model_parity import (
    CALLS,
    KERNEL_CALLS,
    alone_1d,
    assert_each_sample_alone,
    register_attentions,
    text_calls,
    with_attention,
)
from tests.models.build import tiny_models
from tests.oracles import internvl as oracle

pytestmark = pytest.mark.spark

IMG_CONTEXT, TOKENS_PER_TILE = 151667, 256


@pytest.fixture(scope="module")
def internvl(family_run, tmp_path_factory):
    """The run, its tokenized rows and transformers' reference of every row."""
    run = family_run("internvl")
    rows, refs, videos = oracle_references(run, oracle, tmp_path_factory.mktemp("internvl-videos"))
    return run, rows, refs, videos


def test_every_sample_has_the_ids_labels_tiles_and_frames_transformers_gives(internvl):
    run, rows, refs, videos = internvl
    assert run.ctx.config.profile.kind == "internvl"
    assert len(rows) >= 40 and any(m["kind"] == "video" for r in rows for m in r["media"])
    tiled = 0
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        assert [m["num_tokens"] // TOKENS_PER_TILE for m in row["media"]] == ref["tiles"]
        for m in row["media"]:
            tiled += m["kind"] == "image" and m["grid_h"] * m["grid_w"] > 1
            if m["kind"] == "video":
                assert m["frame_indices"] == videos[m["uri"]]["frame_indices"]
    assert tiled >= 20  # images split into several tiles (+ thumbnail), not only single tiles


def sample_tiles(batch, cu: list[int]) -> list[torch.Tensor | None]:
    """Each sample's own tiles, cut out of the batch's pixel values by its context tokens."""
    ids, out, start = batch["input_ids"][0], [], 0
    for a, b in itertools.pairwise(cu):
        tiles = int((ids[a:b] == IMG_CONTEXT).sum()) // TOKENS_PER_TILE
        out.append(batch["pixel_values"][start : start + tiles] if tiles else None)
        start += tiles
    assert start == (len(batch["pixel_values"]) if "pixel_values" in batch else 0)
    return out


def test_packed_samples_have_transformers_pixels_and_restarting_positions(internvl):
    run, rows, refs, _ = internvl
    kinds = {r["sample_id"]: {m["kind"] for m in r["media"]} for r in rows}
    checked = {"image": 0, "video": 0}
    for bin_ in PackedDataset(str(run.output / "packed"), shuffle=False):
        batch = collate_packed([bin_])
        cu = batch.meta["cu_seq_lens"]
        assert batch["position_ids"].shape == (1, cu[-1])
        for (a, b), sample_id, tiles in zip(
            itertools.pairwise(cu), bin_["sample_ids"], sample_tiles(batch, cu), strict=True
        ):
            ref = refs[sample_id]
            assert batch["input_ids"][0, a:b].tolist() == ref["input_ids"]
            assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
            if ref["pixel_values"]:
                expected = np.concatenate(ref["pixel_values"])
                np.testing.assert_allclose(tiles.numpy(), expected, rtol=0, atol=1e-6)
                for kind in kinds[sample_id]:
                    checked[kind] += 1
    assert checked["image"] >= 20 and checked["video"] >= 2, checked


@pytest.fixture(scope="module")
def flash_cpu():
    register_attentions()


@pytest.fixture(scope="module")
def micro_batches(internvl, family_run) -> list[list[dict]]:
    """Small multi-sample bins: an image bin beside a video bin, and one more image bin (read
    once for every attention)."""
    packed, rows = family_run("internvl", TILED_PARITY_BUDGET).output / "packed", internvl[1]
    videos = {r["sample_id"] for r in rows if any(m["kind"] == "video" for m in r["media"])}
    bins = [b for b in PackedDataset(str(packed), shuffle=False) if len(b["sample_ids"]) > 1]
    bins.sort(key=lambda b: len(b["input_ids"]))
    video = next(b for b in bins if videos & set(b["sample_ids"]))
    images = [b for b in bins if "pixel_values" in b and not videos & set(b["sample_ids"])][:2]
    assert len(images) == 2
    return [[images[0], video], [images[1]]]


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_varlen_cpu", "mmpack_varlen"])
def test_packed_equals_each_sample_alone(flash_cpu, micro_batches, attention):
    model = with_attention(tiny_models().tiny_model("internvl", seed=3), attention)
    if attention == "flash_varlen_cpu":  # the language model's; the vision tower's stays SDPA
        model.config.vision_config._attn_implementation_internal = "sdpa"
    CALLS.clear()
    checked = text_layers = 0
    for bins in micro_batches:
        batch = collate_packed(bins)
        assert "cu_seq_lens_q" not in batch  # InternVL hands its kwargs on to the vision tower
        KERNEL_CALLS.clear()
        with torch.no_grad():
            packed = model(**batch)
        if attention == "mmpack_varlen":  # its text layers found the sequences in position_ids
            text_layers += text_calls(batch.meta["cu_seq_lens"])
        tiles = sample_tiles(batch, batch.meta["cu_seq_lens"])
        media = [{"pixel_values": t} if t is not None else {} for t in tiles]
        checked += assert_each_sample_alone(batch, packed, media, functools.partial(alone_1d, model))
    assert checked >= 6
    if attention == "flash_varlen_cpu":  # the text layers found the boundaries in position_ids
        assert CALLS.count("position_ids") >= 3 * model.config.text_config.num_hidden_layers
        assert "cu_seq_lens" not in CALLS
    if attention == "mmpack_varlen":
        assert text_layers == 2 * model.config.text_config.num_hidden_layers


def test_validate_accepts_the_shards(spark, internvl):
    run = internvl[0]
    summary = validate.run(spark, run.ctx)
    assert summary["ok"], summary["problems"]
    assert summary["source"]["rows"] == summary["samples"] + summary["skipped"]
